"""train-dpo's prefix_shared batch layout against the padded one: per-token log-probs of a batch against each
sequence's own unpadded forward, 10 training steps (loss, every logged metric, final weights) on data/ and on a
long-prompt synthetic set, gradient accumulation, a live reference, and how auto chooses."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, WORDS, build_llama, records, save_checkpoint, write_jsonl
from dpo import layout
from dpo.layout import PrefixSharedCollator, choose_layout, pair_logps
from dpo.config import TrainConfig
from dpo.recipe import run_train
from dpo.trainer import PairCollator
from precompute.job import PrecomputeConfig, run_precompute
from schemas.encoding import EncodingConfig
from schemas.stamps import model_hash

# wall-clock and epoch bookkeeping, and the Trainer's FLOP estimate (it counts input slots, which is what the layout
# changes: fewer of them)
NOT_COMPARED = ("runtime", "per_second", "epoch", "total_flos")
TOL = 1e-5


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(a))  # relative for large values (log-prob sums)


def train(model, data, out, **kwargs) -> tuple[dict, list[str]]:
    logs: list[str] = []
    # lr 1e-4: the policy moves (weights by ~1e-3) but stays near the reference; at 1e-3 the k3 KL metric,
    # exp(-log-ratio) per token, multiplies 1e-7 rounding differences of the log-probs by up to e^5 after 10 steps
    options = dict(use_cpu=True, learning_rate=1e-4, per_device_train_batch_size=8, logging_steps=1, seed=3,
                   plot=False, max_steps=10)
    summary = run_train(TrainConfig(model=str(model), data=str(data), output_dir=str(out), **{**options, **kwargs}),
                        log=logs.append)
    return summary, logs


def assert_same_run(a: Path, b: Path, steps: int, start: Path):
    ra, rb = records(a), records(b)
    assert len(ra) == len(rb) and sum("loss" in r for r in ra) == steps
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys() and x["step"] == y["step"]
        for key in x:
            if not any(n in key for n in NOT_COMPARED):
                assert close(x[key], y[key]), f"step {x['step']} {key}: {x[key]} vs {y[key]}"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    w0 = load_file(start / "model.safetensors")
    for name in wa:
        # Adam divides each gradient by its own running RMS, so an element whose gradient is ~0 moves by up to the
        # learning rate on float32 rounding alone: single elements differ by ~1e-5 after 10 steps at lr 1e-4 (seen
        # on this project's CPUs). The training trajectory is compared as a whole instead: the two runs' weight
        # updates agree to 1e-3 of their size, and no element is further apart than half of one step at lr 1e-4.
        da, db = wa[name] - w0[name], wb[name] - w0[name]
        assert float((da - db).norm()) <= 1e-3 * max(float(da.norm()), 1e-12), name
        assert float((da - db).abs().max()) <= 5e-5, name
    assert max(float((wa[n] - w0[n]).abs().max()) for n in wa) > 1e-4  # they trained: not both still the start



@torch.no_grad()
def plain_logps(model, pair) -> list[torch.Tensor]:
    """Independent truth for the tests: each [prompt | completion] alone and unpadded through model(ids).logits."""
    device = next(model.parameters()).device
    out = []
    for completion in (pair.chosen_ids, pair.rejected_ids):
        ids = torch.tensor([pair.prompt_ids + completion], device=device)
        logits = model(input_ids=ids).logits[0, len(pair.prompt_ids) - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(pair.prompt_ids):, None]).squeeze(-1))
    return out

def run_both(model, data, root: Path, **kwargs) -> tuple[Path, Path]:
    out = {}
    for name in ("padded", "prefix_shared"):
        summary, logs = train(model, data, root / name, batch_layout=name, **kwargs)
        assert summary["batch_layout"] == name, logs
        out[name] = root / name
    return out["padded"], out["prefix_shared"]


# ---------------------------------------------------------------------------------------------------------------
# the batch itself


def random_rows(n, seed=0, prompt=(1, 40), completion=(1, 12)):
    rng = random.Random(seed)
    ids = lambda lo_hi: [rng.randrange(3, 300) for _ in range(rng.randint(*lo_hi))]
    return [{"prompt_ids": ids(prompt), "chosen_ids": ids(completion), "rejected_ids": ids(completion),
             "ref_chosen_logps": [float(i)], "ref_rejected_logps": [-float(i)]} for i in range(n)]


def test_prefix_shared_batch_gives_each_sequences_own_forward_in_the_padded_order(tokenizer):
    model = build_llama(len(tokenizer))
    rows = random_rows(9)
    rows[4]["prompt_ids"] = rows[4]["prompt_ids"][:1]  # a one-token prompt
    rows[5]["chosen_ids"] = rows[5]["chosen_ids"][:1]  # a one-token completion
    batch = PrefixSharedCollator(0)(rows)
    assert batch["input_ids"].shape[0] < len(rows)  # pairs were packed several to a row
    with torch.no_grad():
        got = pair_logps(model, batch)
    truth = [plain_logps(model, layout.EncodedPair(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]))
             for r in rows]
    want = torch.cat([t[0] for t in truth] + [t[1] for t in truth])
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < TOL
    padded = PairCollator(0)(rows)
    assert torch.equal(batch["completion_lens"], padded["completion_lens"])
    assert torch.equal(batch["ref_logps"], padded["ref_logps"])
    with torch.no_grad():
        assert float((pair_logps(model, padded) - got).abs().max()) < TOL


def test_gradients_of_the_two_layouts_agree(tokenizer):
    grads = []
    for collate in (PairCollator(0), PrefixSharedCollator(0)):
        model = build_llama(len(tokenizer), seed=1).train()
        logps = pair_logps(model, collate(random_rows(6, seed=2)))
        loss = (logps * torch.linspace(-1, 1, len(logps))).sum()
        loss.backward()
        grads.append(torch.cat([p.grad.ravel() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    assert float(grads[0].abs().max()) > 0


# ---------------------------------------------------------------------------------------------------------------
# 10 steps, padded vs prefix_shared


def other_reference(model_dir: Path, out: Path, seed: int) -> tuple[Path, str]:
    """A perturbed copy of a model to serve as the reference, so that from step 0 on the policy differs from it and
    metrics such as preference accuracy are not decided by float noise around a tie."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.003)
    save_checkpoint(model, AutoTokenizer.from_pretrained(model_dir), out)
    return out, model_hash(out)


@pytest.fixture(scope="module")
def shipped_cache(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("shipped")
    reference, digest = other_reference(DATA / "sft-model", root / "reference", seed=11)
    caches = {"hash": digest}
    for split in ("train", "test"):
        caches[split] = root / split
        run_precompute(PrecomputeConfig(model=str(reference), data=str(DATA / "prefs"), split=split,
                                        out=str(caches[split]), progress=False), log=lambda m: None)
    return caches


def test_ten_steps_on_the_shipped_data_equal_the_padded_layout(tmp_path, shipped_cache):
    padded, shared = run_both(DATA / "sft-model", DATA / "prefs", tmp_path, ref_cache=str(shipped_cache["train"]),
                              ref_model_hash=shipped_cache["hash"], eval_data=str(DATA / "prefs"),
                              eval_ref_cache=str(shipped_cache["test"]), eval_steps=10, per_device_eval_batch_size=50)
    assert_same_run(padded, shared, 10, DATA / "sft-model")
    assert any("eval_loss" in r for r in records(shared))


def long_prompt_rows(n=24, seed=5) -> list[dict]:
    rng = random.Random(seed)
    words = lambda a, b: " ".join(rng.choice(WORDS) for _ in range(rng.randint(a, b)))
    return [{"id": f"l{i:03d}", "prompt": words(60, 140) + "?", "chosen": "sure " + words(2, 10),
             "rejected": "hmm " + words(2, 10)} for i in range(n)]


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory, tokenizer) -> dict:
    root = tmp_path_factory.mktemp("long")
    model = save_checkpoint(build_llama(len(tokenizer), seed=4, hidden=64), tokenizer, root / "model")
    reference, digest = other_reference(model, root / "reference", seed=12)
    data = write_jsonl(root / "data" / "train.jsonl", long_prompt_rows())
    cache = root / "cache"
    run_precompute(PrecomputeConfig(model=str(reference), data=str(data), out=str(cache), progress=False,
                                    encoding=EncodingConfig(max_length=512)), log=lambda m: None)
    return {"model": model, "data": data, "cache": cache, "reference": reference, "hash": digest}


def test_ten_steps_on_long_prompts_equal_the_padded_layout(tmp_path, long_prompts):
    padded, shared = run_both(long_prompts["model"], long_prompts["data"], tmp_path,
                              ref_cache=str(long_prompts["cache"]), ref_model_hash=long_prompts["hash"],
                              per_device_train_batch_size=4)
    assert_same_run(padded, shared, 10, long_prompts["model"])


def test_gradient_accumulation_with_prefix_shared_matches_a_padded_larger_batch(tmp_path, long_prompts):
    common = dict(ref_cache=str(long_prompts["cache"]), ref_model_hash=long_prompts["hash"], max_steps=3)
    train(long_prompts["model"], long_prompts["data"], tmp_path / "big", batch_layout="padded",
          per_device_train_batch_size=8, **common)
    train(long_prompts["model"], long_prompts["data"], tmp_path / "acc", batch_layout="prefix_shared",
          per_device_train_batch_size=4, gradient_accumulation_steps=2, **common)
    assert_same_run(tmp_path / "big", tmp_path / "acc", 3, long_prompts["model"])


def test_live_reference_runs_on_the_same_packed_batch(tmp_path, long_prompts):
    padded, shared = run_both(long_prompts["model"], long_prompts["data"], tmp_path,
                              ref_model=str(long_prompts["reference"]), per_device_train_batch_size=4, max_steps=3)
    assert_same_run(padded, shared, 3, long_prompts["model"])


# ---------------------------------------------------------------------------------------------------------------
# choosing


def test_auto_picks_prefix_shared_on_long_prompts_and_says_why(tmp_path, long_prompts):
    summary, logs = train(long_prompts["model"], long_prompts["data"], tmp_path / "auto",
                          ref_cache=str(long_prompts["cache"]), ref_model_hash=long_prompts["hash"], max_steps=1)
    assert summary["batch_layout"] == "prefix_shared"
    line = [m for m in logs if m.startswith("batch layout:")]
    assert len(line) == 1 and "less work than padded" in line[0] and "probe" in line[0]
    manifest = json.loads((tmp_path / "auto" / "run-manifest.json").read_text())
    assert manifest["result"]["batch_layout"] == "prefix_shared" and manifest["config"]["batch_layout"] == "auto"


def test_unknown_layout_is_refused_before_any_work(tmp_path):
    from runtime.errors import JobError

    with pytest.raises(JobError, match="--batch-layout must be auto, padded or prefix_shared, got 'tree'"):
        train(DATA / "sft-model", DATA / "prefs", tmp_path / "out", ref_cache=str(tmp_path / "none"),
              batch_layout="tree")
    assert not (tmp_path / "out").exists()


def _table(rows):
    import pyarrow as pa

    return pa.Table.from_pylist([{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows])


def test_auto_falls_back_when_the_model_cannot_take_the_tree_mask(tokenizer):
    rows = _table(random_rows(8, prompt=(40, 80)))
    windowed = build_llama(len(tokenizer), sliding_window=16, layer_types=["sliding_attention"] * 2)
    logs: list[str] = []
    assert choose_layout("auto", [windowed], rows, 4, 0, logs.append) == "padded"
    assert logs == [logs[0]] and "sliding-window attention (window 16" in logs[0]
    assert choose_layout("prefix_shared", [windowed], rows, 4, 0, logs.append) == "padded"
    assert "although prefix_shared was requested" in logs[1]
    plain = build_llama(len(tokenizer))
    assert choose_layout("auto", [plain], rows, 4, 0, logs.append) == "prefix_shared"
    # a live reference that cannot take it keeps the policy on the padded layout too
    assert choose_layout("auto", [plain, windowed], rows, 4, 0, logs.append) == "padded"


def test_auto_keeps_padded_when_sharing_saves_no_work(tokenizer):
    rows = _table(random_rows(8, prompt=(1, 2), completion=(30, 40)))  # almost no prompt to share
    logs: list[str] = []
    assert choose_layout("auto", [build_llama(len(tokenizer))], rows, 4, 0, logs.append) == "padded"
    assert "no less work" in logs[0]


def test_probe_catches_a_layout_that_is_wrong(tokenizer, monkeypatch):
    rows = _table(random_rows(8, prompt=(10, 30)))
    real = layout.tree_inputs

    def positions_not_restarted(*args, **kwargs):  # rejected tokens placed after chosen, as a naive packer would
        ids, pos, allowed, *rest = real(*args, **kwargs)
        return (ids, torch.arange(pos.shape[1]).expand_as(pos).contiguous(), allowed, *rest)

    monkeypatch.setattr(layout, "tree_inputs", positions_not_restarted)
    logs: list[str] = []
    assert choose_layout("prefix_shared", [build_llama(len(tokenizer))], rows, 4, 0, logs.append) == "padded"
    assert "differs from the reference forward" in logs[0]


def test_probe_includes_the_longest_pair():
    rows = random_rows(30, prompt=(5, 60))
    table = _table(rows)
    lengths = layout.table_lengths(table)
    probe = layout.probe_pairs(table, lengths)
    total = lambda p: len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)
    assert max(map(total, probe)) == int(lengths.sum(1).max())
    assert min(map(total, probe)) == int(lengths.sum(1).min())
    assert len({len(p.prompt_ids) for p in probe}) == len(probe) == 3
