"""Batches in which no query sees a key: told apart, and answered without a kernel (the cpu
and cuda launch paths both do this)."""

from __future__ import annotations

from attention_service.engine.batch_plan import BatchPlan


def no_keys(plan: BatchPlan) -> bool:
    """No query of the batch sees a key (cached ops: nothing cached and nothing new)."""
    if plan.op.cached:
        return plan.max_seqlen_k == 0
    return plan.total_k == 0


def fill_no_keys(plan: BatchPlan) -> None:
    """No query sees a key: outputs are zeros and lse -inf, no kernel."""
    for job in plan.jobs:
        job.out.zero_()
        if job.lse is not None:
            job.lse.fill_(float("-inf"))
