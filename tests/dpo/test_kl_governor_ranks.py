"""train-dpo's KL governor under torchrun (issue 35): 2 gloo ranks on CPU, a top-k cache of data/, a band below the
run's KL so that β moves at every step. Every rank's loss must use the same β at every step (the rule reads the
KL means gathered over the ranks, so each rank decides alike), and that β is the one rank 0 logs."""

from __future__ import annotations

import json
import math
from pathlib import Path


from conftest import DATA, TORCHRUN, records, run_in_session

MODEL = DATA / "sft-model"
STEPS = 4  # of 2 ranks x 2 pairs: the 16 pairs of kl_pairs

# train-dpo as the whole process, with each rank noting the β its training loss was computed with (dpo/trainer.py
# reads it from loss_config, which the governor sets before every step); the only way to see a rank other than 0,
# which alone writes metrics.jsonl.
DRIVER = """
import json, os, sys
sys.path[:0] = {paths!r}
from dpo import trainer
from dpo.cli import process_main

compute_loss = trainer.DPOTrainer.compute_loss

def noting_beta(self, model, inputs, *args, **kwargs):
    if model.training:
        with open(os.path.join({notes!r}, "beta-rank" + os.environ["RANK"] + ".jsonl"), "a") as f:
            f.write(json.dumps({{"step": self.state.global_step + 1, "beta": self.loss_config.beta}}) + "\\n")
    return compute_loss(self, model, inputs, *args, **kwargs)

trainer.DPOTrainer.compute_loss = noting_beta
sys.argv = ["train-dpo", *sys.argv[1:]]
process_main()
"""


def test_two_gloo_ranks_hold_the_same_beta_at_every_step_of_a_band_controller(kl_pairs, tmp_path):
    data, cache = kl_pairs
    repo = Path(__file__).resolve().parent.parent.parent
    notes = tmp_path / "notes"
    notes.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(paths=[str(repo)], notes=str(notes)))
    out = tmp_path / "run"
    run_in_session([*TORCHRUN, str(driver), "--model", str(MODEL), "--data", str(data), "--ref-cache", str(cache),
                    "--output-dir", str(out), "--use-cpu", "--no-plot", "--per-device-train-batch-size", "2",
                    "--max-steps", str(STEPS), "--logging-steps", "1", "--save-strategy", "no",
                    "--learning-rate", "1e-4", "--seed", "1", "--beta", "0.1",
                    "--kl-target", "1e-15:2e-15", "--kl-adapt-every", "1"], tmp_path, timeout=600)

    noted = {}
    for rank in (0, 1):
        lines = (notes / f"beta-rank{rank}.jsonl").read_text().splitlines()
        noted[rank] = {r["step"]: r["beta"] for r in map(json.loads, lines)}
        assert len(lines) == STEPS and sorted(noted[rank]) == list(range(1, STEPS + 1)), (rank, lines)
    assert noted[0] == noted[1]  # exactly: the same float on both ranks at every step

    steps = {r["step"]: r for r in records(out) if "loss" in r}
    assert {s: r["beta"] for s, r in steps.items()} == noted[0]  # what rank 0 logged is what both ranks trained with
    decisions = [r for r in records(out) if r.get("event") == "kl_control"]
    assert [d["step"] for d in decisions] == list(range(1, STEPS + 1))
    # each decision on the KL of both ranks' pairs (the logged mean), not on one rank's own
    assert all(math.isclose(d["kl"], steps[d["step"]]["kl/policy_ref/chosen"], rel_tol=1e-12) for d in decisions)
    # the band moved β at every interval (step 1's KL, policy = reference, is 0 or float noise far above 2e-15)...
    assert all(d["before"] != d["after"] for d in decisions), decisions
    assert [noted[0][s] for s in range(2, STEPS + 1)] == [d["after"] for d in decisions[:-1]]  # ...on both ranks
    assert len(set(noted[0].values())) == STEPS
