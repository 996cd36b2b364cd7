"""Simulate ``spread``: how many of a server's front ends N clients' connections end on.

The kernel hashes each new connection to one of the N front ends sharing the port
(SO_REUSEPORT; the source port is random, so uniformly at random). A client with
``spread=True`` asks where its connection fell (GetServerInfo with counts) and, if
``crowded``, opens a new one, up to ``spread_tries`` looks. This replays that rule (the
client's own ``crowded`` and ``spread_tries``) against two arrival orders:

- ``one by one``: each client places its connection before the next one starts;
- ``at once``: every client connects first, then they look in random turns, each seeing the
  counts as they are at its turn (the bench's clients all start together).

It prints, per case, how often all front ends (or all clients, when fewer) held a
connection, the mean number used, and looks per client, for the tries rule in the client
and for fixed numbers of tries (``--fixed``) to compare with.

    python tools/tuning/sim_spread.py --cases 8x8,16x16,8x12,4x4 --trials 20000
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

from attention_client._channel import crowded, spread_tries
from attention_wire.pb import attention_pb2 as pb


def _looks(counts: list[int], mine: int) -> pb.ServerInfo:
    return pb.ServerInfo(frontends=len(counts), frontend_connections=counts[mine],
                         fewest_frontend_connections=min(counts))


def place_one_by_one(n: int, clients: int, tries: Callable[[pb.ServerInfo], int],
                     rng: random.Random) -> tuple[list[int], int]:
    counts, looks = [0] * n, 0
    for _ in range(clients):
        done = 0
        while True:
            mine = rng.randrange(n)
            counts[mine] += 1
            info = _looks(counts, mine)
            done += 1
            if not crowded(info) or done >= tries(info):
                break
            counts[mine] -= 1
        looks += done
    return counts, looks


def place_at_once(n: int, clients: int, tries: Callable[[pb.ServerInfo], int],
                  rng: random.Random) -> tuple[list[int], int]:
    counts = [0] * n
    where = [rng.randrange(n) for _ in range(clients)]
    for fe in where:
        counts[fe] += 1
    done = [0] * clients
    waiting = list(range(clients))
    looks = 0
    while waiting:
        rng.shuffle(waiting)
        still = []
        for c in waiting:
            info = _looks(counts, where[c])
            done[c] += 1
            looks += 1
            if not crowded(info) or done[c] >= tries(info):
                continue
            counts[where[c]] -= 1
            where[c] = rng.randrange(n)
            counts[where[c]] += 1
            still.append(c)
        waiting = still
    return counts, looks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="8x8,16x16,8x12,4x4,2x2",
                   help="comma list of FRONTENDSxCLIENTS")
    p.add_argument("--fixed", default="4", help="comma list of fixed tries to compare with")
    p.add_argument("--trials", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rules: list[tuple[str, Callable[[pb.ServerInfo], int]]] = [("client", spread_tries)]
    for t in (int(x) for x in args.fixed.split(",") if x):
        rules.append((f"fixed {t}", lambda info, t=t: t))
    print(f"{'front ends x clients':>20} {'order':>10} {'tries':>9} {'all used':>9} "
          f"{'mean used':>9} {'looks/client':>12}")
    for case in args.cases.split(","):
        n, clients = (int(x) for x in case.split("x"))
        target = min(n, clients)
        for order, place in (("one by one", place_one_by_one), ("at once", place_at_once)):
            for name, tries in rules:
                rng = random.Random(args.seed)
                full = used = looks = 0
                for _ in range(args.trials):
                    counts, k = place(n, clients, tries, rng)
                    u = sum(1 for c in counts if c)
                    full += u == target
                    used += u
                    looks += k
                print(f"{case:>20} {order:>10} {name:>9} {full / args.trials:>9.3f} "
                      f"{used / args.trials:>9.2f} {looks / args.trials / clients:>12.2f}")


if __name__ == "__main__":
    main()
