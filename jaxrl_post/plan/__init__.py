"""Planning a run at real sizes without weights or hardware: memory, cost and a verdict.

`memory` compiles single programs on abstract arrays and reads XLA's memory analysis;
`targets` names the hardware (local devices, TPU slices through libtpu's compile-only
topologies, GPU nodes); `programs` compiles a run's own programs for a target;
`hlo_cost` reads their FLOPs, bytes and launches from the compiled text, loops counted;
`buffers` names their largest allocations; `report` turns all of it into predicted
seconds and the verdict (`report.plan_of`: an Experiment's Plan on a target, what the CLI
and `scripts/bench_step.py --plan` call). The CLI is `python -m jaxrl_post.plan`.
"""

from jaxrl_post.plan.memory import (GB, Allocation, CompiledMemory, PoolPlan, TrainStepMemory,
                                    abstract_reference, abstract_step_batch,
                                    abstract_train_state, compile_with_allocations,
                                    compiled_memory, decode_loop_memory, device_bytes,
                                    head_positions_bound, kv_head_shards, micro_batch_shape, kv_pool_pages,
                                    lower_train_step,
                                    reference_bytes, rollout_bytes, single_device_mesh,
                                    train_step_memory, weight_bytes)

__all__ = ["GB", "Allocation", "CompiledMemory", "PoolPlan", "TrainStepMemory", "abstract_reference", "abstract_step_batch", "abstract_train_state", "compile_with_allocations", "compiled_memory", "decode_loop_memory", "device_bytes", "head_positions_bound", "kv_head_shards", "micro_batch_shape", "kv_pool_pages", "lower_train_step", "reference_bytes", "rollout_bytes", "single_device_mesh", "train_step_memory", "weight_bytes"]
