"""The machine a run is on: what it must have for a launch (`checks`: a torch that can use its GPU, NVMe offload's libaio and CUDA
toolkit, host RAM), DeepSpeed's CPU question
answered once per machine (`cpu_info`) and its JIT ops' build locks (`extension_locks`), host-device syncs
counted by name (`host_syncs`), and profiler traces (`profiling`)."""
