"""dpo/trainer.py: the pair collator's batch layout (chosen rows, then rejected rows, right-padded; cached reference
values in the same order) and dropout switched off everywhere. The Trainer loop itself is exercised end to end in
test_recipe.py."""

from __future__ import annotations

import torch

from conftest import build_llama
from dpo.trainer import PairCollator, disable_dropout


def test_pair_collator_lays_out_chosen_then_rejected_with_their_reference_values():
    rows = [{"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9, 10],
             "ref_chosen_logps": [-1.0], "ref_rejected_logps": [-2.0, -3.0, -4.0]},
            {"prompt_ids": [11], "chosen_ids": [12, 13], "rejected_ids": [14],
             "ref_chosen_logps": [-5.0, -6.0], "ref_rejected_logps": [-7.0]}]
    batch = PairCollator(pad_id=0)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [11, 12, 13, 0, 0], [5, 6, 8, 9, 10], [11, 14, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["prompt_lens"].tolist() == [2, 1, 2, 1] and batch["completion_lens"].tolist() == [1, 2, 3, 1]
    # flattened in the order completion_logps returns the policy's values: row by row, chosen rows first
    assert batch["ref_logps"].tolist() == [-1.0, -5.0, -6.0, -2.0, -3.0, -4.0, -7.0]
    assert batch["ref_logps"].dtype == torch.float32


def test_pair_collator_without_cached_values_has_no_ref_logps():
    batch = PairCollator(pad_id=3)([{"prompt_ids": [5], "chosen_ids": [6], "rejected_ids": [7, 8]}])
    assert "ref_logps" not in batch and batch["input_ids"].tolist() == [[5, 6, 3], [5, 7, 8]]


def test_disable_dropout_sets_every_dropout_to_zero():
    model = build_llama(64, attention_dropout=0.3)
    model.model.extra = torch.nn.Dropout(0.5)  # a dropout module anywhere in the tree
    assert any(getattr(m, "attention_dropout", 0) == 0.3 for m in model.modules())
    disable_dropout(model)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(m.attention_dropout == 0.0 for m in model.modules() if isinstance(getattr(m, "attention_dropout", None), float))
    model.train()
    ids = torch.tensor([[1, 5, 9, 12]])
    assert torch.equal(model(ids).logits, model(ids).logits)  # deterministic in train mode


# ---------------------------------------------------------------------------------------------------------------
# issue 25 item 10: metrics.png, read back from the Figure it is drawn from


def _run_records(steps: int, kl: bool = False) -> list[dict]:
    """metrics.jsonl records as a run logs them: train every step, eval at 0 and every 5 steps."""
    from dpo.trainer import KL_PANELS, PANELS

    keys = [k for panel in PANELS + (KL_PANELS if kl else ()) for k, _ in panel.series]
    out = [{"step": 0, **{f"eval_{k}": 0.5 for k in keys if k != "learning_rate"}}]
    for step in range(1, steps + 1):
        out.append({"step": step, "epoch": step / steps, "grad_norm": 1.0, **{k: 0.5 - step / 100 for k in keys}})
        if step % 5 == 0:
            out.append({"step": step, **{f"eval_{k}": 0.4 for k in keys if k != "learning_rate"}})
    return out


def _drawn(records):
    from dpo.trainer import metrics_figure, plot_title

    fig = metrics_figure(records, plot_title("run-7", "ipo", 0.25, 5e-7))
    fig.canvas.draw()  # the layout is done at draw time
    return fig


def test_metrics_figure_is_titled_labelled_and_its_legends_stay_off_the_curves():
    fig = _drawn(_run_records(3))
    assert fig.get_suptitle() == "run-7: loss ipo, β = 0.25, learning rate 5e-07"
    axes = fig.axes
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_window_extent(renderer) for ax in axes]
    for ax in axes:
        assert ax.get_title() and ax.get_ylabel() and ax.get_xlabel() == "step"
        # whole-number steps, even over a run of 3 steps
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
        legend = ax.get_legend()
        labels = [t.get_text() for t in legend.get_texts()]
        assert labels and all(label in ("train", "eval", "train, chosen", "eval, chosen", "train, rejected",
                                        "eval, rejected") for label in labels), labels  # not raw metric keys
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(other) for other in boxes), ax.get_title()  # over no panel, its own included
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)  # and not cut off


def test_metrics_figure_has_one_accuracy_notion_per_panel_and_the_kl_panels_with_a_top_k_cache():
    def plotted(fig):
        return {ax.get_title(): {line.get_gid().removeprefix("eval_") for line in ax.lines} for ax in fig.axes}

    plain = plotted(_drawn(_run_records(10)))
    accuracies = [keys for keys in plain.values() if any("accuracies" in k for k in keys)]
    assert sorted(map(sorted, accuracies)) == [["logps/accuracies"], ["rewards/accuracies"]]
    assert not any(k.startswith(("kl/", "ref_top_k_mass")) for keys in plain.values() for k in keys)
    with_kl = plotted(_drawn(_run_records(10, kl=True)))
    assert len(with_kl) == len(plain) + 3
    kl = [keys for keys in with_kl.values() if any(k.startswith(("kl/", "ref_top_k_mass")) for k in keys)]
    # one direction (or the top-k mass) per panel, chosen and rejected
    assert sorted(map(sorted, kl)) == [[f"{q}/chosen", f"{q}/rejected"]
                                       for q in ("kl/policy_ref", "kl/ref_policy", "ref_top_k_mass")]
    eval_lines = [line for ax in _drawn(_run_records(10)).axes for line in ax.lines if line.get_gid() == "eval_loss"]
    assert list(eval_lines[0].get_xdata()) == [0, 5, 10]


def test_plot_metrics_writes_a_png_of_the_figure(tmp_path):
    """metrics.png (dpo.trainer.plot_metrics) reads back as an image of the figure's size at PNG_DPI, not blank."""
    import json

    from matplotlib.image import imread

    from dpo.metrics import metrics_records
    from dpo.trainer import PNG_DPI, metrics_figure, plot_metrics

    for kl in (False, True):
        path = tmp_path / "metrics.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _run_records(12, kl=kl)))
        plot_metrics(path, tmp_path / "metrics.png", "a title")
        pixels = imread(tmp_path / "metrics.png")
        width, height = metrics_figure(metrics_records(path), "a title").get_size_inches() * PNG_DPI
        assert abs(pixels.shape[1] - width) <= 1 and abs(pixels.shape[0] - height) <= 1
        assert pixels[..., :3].std() > 0.05  # lines and text drawn on the background
        (tmp_path / "metrics.png").unlink()
