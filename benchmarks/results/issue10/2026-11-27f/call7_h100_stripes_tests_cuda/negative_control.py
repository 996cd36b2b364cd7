import contextlib, sys, torch
sys.path.insert(0, ".")
import attention_client.client as cl
from attention_client import AttentionClient
from attention_client import _stripes
from tests.client._fakes import start_fake
_stripes.STRIPE_MIN_BYTES = 0
def run(label):
    server, _, port = start_fake()
    bad = 0
    side = torch.cuda.Stream()
    with AttentionClient(f"localhost:{port}", stripes=4, unary=False, call_streams=False) as c:
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            src = torch.randn(512, 8, 64, generator=g).cuda()
            q = torch.zeros_like(src); k = torch.zeros(512, 4, 64, device="cuda")
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000); q.copy_(src); out = c.attention(q, k, k)
            bad += not torch.equal(out.cpu(), src.cpu())
    server.stop(None)
    print(f"{label}: {bad}/5 calls returned stale q")
run("with the caller's stream")
cl.caller_stream = lambda x: contextlib.nullcontext
run("without it (negative control)")
