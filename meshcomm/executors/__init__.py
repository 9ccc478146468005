"""Layer 3, executors: they run plans and decide nothing.

`local` (the local steps and transfer packing both executors share), `steps` (the table
of step kinds both implement), `sim` (exact simulated ranks) and `distributed`
(torch.distributed: NCCL on GPUs, gloo on CPU, one code path).
"""
