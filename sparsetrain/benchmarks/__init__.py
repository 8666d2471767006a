"""The benchmarks, one module each, run as ``python -m sparsetrain.benchmarks.<name>``:

- ``step``: step time by phase on the bandwidth-limited cluster, every scheme as the studies
  train it, interleaved rounds, medians with 95% intervals (``make bench-step``);
- ``ddp``: DDP with sparsetrain's hooks vs torch's PowerSGD / fp16 hooks (``make bench-ddp``);
- ``collectives``: gloo AllReduce / AllGather micro-benchmark, alpha-beta fit, model check
  (``make bench-model``);
- ``compress``: the compressors in gradient copies (``make bench``);
- ``step_device``: one rank on one device, dense vs every scheme and scope (``make gpu-check``);
- ``compare``: ``make run``'s four short trainings and their table.

Shared machinery: ``harness`` (the cluster runs through ``sparsetrain.launch.netcluster``, the
rows built from the studies' config, the timing loop over ``train.step.TrainStep``, rounds),
``timing_stats`` (medians, intervals, flags; no torch); tables through the command line's own
formatter (``sparsetrain.launch.report.grid``). Nothing in ``sparsetrain`` imports this package; the old ``scripts/*.py`` command lines are thin wrappers.
"""
