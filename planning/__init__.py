"""Planning a job before it waits in a queue: will it fit, how fast, what breaks at scale.

  planning/layouts.py      the layouts a config can run in on N GPUs, each one's memory
                           per rank (the planner: `python -m bench.memory_plan`)
  training/memory_plan.py  how a rank's memory is traced, on fake tensors
  planning/fake_world.py   one process as rank r of a world of N (the fake backend)
"""
