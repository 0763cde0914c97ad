"""Several runs of the loop, one after another in the ranks of one `accelerate launch` (tests/test_deepspeed.py,
tests/test_loop.py).

    accelerate launch --config_file launch/cpu.yaml --deepspeed_config_file ds_configs/zero0.json \\
        tests/one_launch_several_runs.py '[["zero0", "zero0", []], ["z3", "zero3", ["--max_steps", "1"]]]' \\
        <the loop's flags shared by every run>

Each entry is `[run name, ds config, the run's own flags]`, and each run is what `accelerate launch
--deepspeed_config_file ds_configs/<ds config>.json loops/mlm.py <shared flags> --run_name <name> <own flags>`
makes: the launcher's only per-config setting is that file's path (`ACCELERATE_DEEPSPEED_CONFIG_FILE`), set here
before each run (a ds config of `null`: the launch's own setting, e.g. DDP without DeepSpeed, is left alone). Between runs accelerate's state singletons and transformers' ZeRO-3 flag (a weak reference to
the last ds config) are reset, and the process group is kept: the ranks start, import and join the group once
for all the runs (about 10 s of each launch on 2 cores), not once per run. The group is destroyed after the last
run, as the loop does at its end.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402
from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # noqa: E402

import loops.mlm as mlm  # noqa: E402


def main(argv: list[str]) -> int:
    runs, shared = json.loads(argv[0]), argv[1:]
    keep_group = PartialState.destroy_process_group
    PartialState.destroy_process_group = lambda self, group=None: None  # each run's end_training keeps it
    try:
        for name, ds_config, own in runs:
            if ds_config is not None:
                os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(ROOT / "ds_configs" / f"{ds_config}.json")
            if code := mlm.main([*shared, "--run_name", name, *own]):
                return code
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            unset_hf_deepspeed_config()
    finally:
        PartialState.destroy_process_group = keep_group
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
