"""Cross-plan resume: a DCP checkpoint saved under one plan (auto, world 4) loads under another
(TorchTitan's TP recipe, world 2) and training continues as if uninterrupted."""

import pytest

from tests.support.parity import SINGLE_RANK, assert_parity, make_seed_checkpoint, run_job

# the learning rate must not depend on the total step count (constant after warmup)
SCHEDULE = ["--lr_scheduler.min_lr_factor=1.0"]


@pytest.mark.slow  # four runs (50 s on 2 cores), measured passing; ``-m slow`` runs it
def test_resume_under_another_plan_and_world_size(tmp_path):
    seed = make_seed_checkpoint("llama3_debug_fsdp.toml", tmp_path / "seed")
    folder = tmp_path / "ckpt"
    start = ["--checkpoint.enable", f"--checkpoint.initial_load_path={seed}",
             f"--checkpoint.folder={folder}"]
    # uninterrupted reference: 8 steps on one rank
    full = run_job("llama3_debug_fsdp.toml", 1, tmp_path / "full",
                   [*SINGLE_RANK, *SCHEDULE, "--training.steps=8"], seed_checkpoint=seed)
    # plan A: auto on 4 ranks, 4 steps, full checkpoint at step 4
    first = run_job("llama3_debug_auto.toml", 4, tmp_path / "a",
                    [*SCHEDULE, *start, "--training.steps=4", "--checkpoint.interval=4",
                     "--checkpoint.no-last_save_model_only"])
    assert first.returncode == 0, first.output[-4000:]
    assert (folder / "step-4").is_dir(), first.output[-3000:]
    # plan B: TorchTitan's tp recipe on 2 ranks resumes from step 4 and runs to step 8
    second = run_job("llama3_debug_tp.toml", 2, tmp_path / "b",
                     [*SCHEDULE, "--checkpoint.enable", f"--checkpoint.folder={folder}",
                      "--training.steps=8", "--checkpoint.interval=100"])
    assert second.returncode == 0, second.output[-4000:]
    assert [r["step"] for r in second.rows] == [5, 6, 7, 8], second.output[-3000:]
    combined = type(full)(0, "", first.rows + second.rows)
    worst = assert_parity(full, combined)
    print(f"resumed run vs uninterrupted: max rel diff {worst:.2e}")
