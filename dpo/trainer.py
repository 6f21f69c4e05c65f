"""DPO on `transformers.Trainer`: the loop, distribution, precision, checkpointing and trackers are the Trainer's;
what is ours is the batch layout, the loss on cached (or live) reference log-probs, and the metrics."""

from __future__ import annotations

import io
import json
import math
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from runtime.disk import writing
from runtime.errors import NonFiniteError
from runtime.logprobs import pad_sequences
from storage.files import append_text, atomic_write

from .metrics import metrics_records
from .layout import pair_logps, reference_columns
from .losses import LossConfig, TopK, dpo_loss


class PairCollator:
    """Rows -> one right-padded batch of 2B sequences: chosen_0..chosen_{B-1}, rejected_0..rejected_{B-1}.

    Cached reference values travel inside the rows, so they follow them through any sampler or process split.
    """

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        prompts = [r["prompt_ids"] for r in rows]
        completions = [r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows]
        ids, mask = pad_sequences([p + c for p, c in zip(prompts + prompts, completions)], self.pad_id)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "prompt_lens": torch.tensor([len(p) for p in prompts + prompts]),
            "completion_lens": torch.tensor([len(c) for c in completions]),
        }
        return batch | reference_columns(rows)


def disable_dropout(model) -> None:
    """DPO compares the policy with a frozen reference; dropout would make them differ at step 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class DPOTrainer(Trainer):
    def __init__(self, *args, loss_config: LossConfig, ref_model=None, save_with=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_with = save_with  # called with each folder the weights are saved to (checkpoints included)
        self.loss_config = loss_config
        self.ref_model = ref_model  # live-reference mode only; None with a cache
        self.model_accepts_loss_kwargs = False  # our loss is a per-batch mean; let the Trainer scale for accumulation
        self.last_checkpoint: Path | None = None  # the checkpoint this run last wrote (or resumed from)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        # hooks (dpo/kl_governor.py): called with (split, {metric: mean over all ranks' pairs}, pairs) per batch, and
        # with the split at each log for more keys of the record
        self.batch_observers: list = []
        self.log_extras: list = []
        self.beta_dpo = None  # --loss-type beta_dpo: its moving state (dpo/losses.py BetaDPO), training batches only

    # --- the guard: a non-finite loss, gradient norm or weight stops the run (exit 3), before anything is saved
    # from it. One rule for the three, checked where each is known on every process alike: the loss as gathered for
    # the metrics (compute_loss), the gradient norm before the optimizer step (_get_grad_norm), the weights before
    # any save (save_model: checkpoints and the final model).

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, (str, Path)):
            self.last_checkpoint = Path(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _stop_if_not_finite(self, what: str, value, step: int) -> None:
        """`value`: a number, or the text saying what it is where there is no one number."""
        if not isinstance(value, str) and math.isfinite(value):
            return
        last = str(self.last_checkpoint) if self.last_checkpoint is not None else "none"
        raise NonFiniteError(
            f"training stopped at step {step}: {what} {value} (not finite); "
            f"nothing from this step on is saved (no final model). Last checkpoint written: {last}. Lower "
            "--learning-rate or --max-grad-norm, check the loss options and the data, and resume from the last "
            "checkpoint or start again")

    def _check_weights(self, folder: Path) -> None:
        """Before anything is written to `folder`: weights that are not finite are never saved."""
        if not self._weights_finite():
            self._stop_if_not_finite(f"the weights to be saved to {folder} are", "NaN or infinite in places",
                                     self.state.global_step)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)
        # with fp16 loss scaling an infinite norm is the scaler's business (it skips that step and lowers the scale)
        if grad_norm is not None and getattr(self.accelerator, "scaler", None) is None:
            value = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else float(grad_norm)
            self._stop_if_not_finite("the gradient norm is", value, self.state.global_step + 1)
        return grad_norm

    def _weights_finite(self) -> bool:
        device = self.args.device
        with torch.no_grad():  # one flag per tensor, read back once
            flags = [torch.isfinite(p).all().to(device) for p in self.model.parameters() if p.numel()]
            bad = (~torch.stack(flags)).any().float().reshape(1) if flags else torch.zeros(1, device=device)
        return not bool(self.accelerator.gather(bad).any())  # every process answers alike

    def save_model(self, output_dir=None, _internal_call=False):
        folder = Path(output_dir or self.args.output_dir)
        if not _internal_call:  # (a checkpoint's weights are checked before its folder is made: _save_checkpoint)
            self._check_weights(folder)
        final = writing(folder, "the model saved there is incomplete") if not _internal_call else nullcontext()
        with final:  # (a checkpoint's save says so itself: _save_checkpoint)
            super().save_model(output_dir, _internal_call)
            # Inside _save_checkpoint this runs before trainer_state.json, which marks a checkpoint complete.
            if self.save_with is not None and self.args.should_save:
                self.save_with(folder)

    def _save_checkpoint(self, model, trial):
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._check_weights(folder)
        with writing(folder, f"{folder.name} is incomplete (no whole trainer_state.json) and will not be resumed"):
            if self.save_with is not None and self.args.should_save:
                # The record first: a folder interrupted at any later point is provably ours (--overwrite-output-dir
                # may retire it); and a stale trainer_state.json must not make a re-save look complete before it is.
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "trainer_state.json").unlink(missing_ok=True)
                self.save_with(folder)
            super()._save_checkpoint(model, trial)
        self.last_checkpoint = folder

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        lengths = inputs["completion_lens"]
        top_k = None
        # either batch layout (layout.py); a live reference runs on the same batch
        if "ref_top_ids" in inputs:  # a top-k cache: the policy's log-probs of the reference's ids, same forward
            policy, at_ids, rest = pair_logps(model, inputs, given=inputs["ref_top_ids"])
            top_k = TopK(at_ids, rest, inputs["ref_top_logps"], inputs["ref_tail"])
        else:
            policy = pair_logps(model, inputs)
        if self.ref_model is not None:
            with torch.no_grad():
                ref = pair_logps(self.ref_model, inputs).to(policy.device)  # split: its head may be elsewhere
        else:
            ref = inputs["ref_logps"]
        loss, metrics = dpo_loss(policy, ref, lengths, self.loss_config, top_k,
                                 beta_dpo=self.beta_dpo if model.training else None)
        split = "train" if model.training else "eval"
        metrics["loss"] = loss.detach().expand(len(lengths) // 2)
        # One gather of a [pairs, metrics] table per step: the means are over all pairs of all processes.
        table = torch.stack([v.float() for v in metrics.values()], dim=1)
        gather = self.accelerator.gather if split == "train" else self.accelerator.gather_for_metrics
        gathered = gather(table)
        means = dict(zip(metrics, gathered.mean(0).tolist()))
        for name, value in means.items():
            self._metrics[split][name].append(value)
        if split == "train":  # the loss over every process's pairs: each process stops alike
            self._stop_if_not_finite("the loss is", self._metrics[split]["loss"][-1], self.state.global_step + 1)
        for observe in self.batch_observers:
            observe(split, means, len(gathered))
        return (loss, {}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict, start_time=None):
        split = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        prefix = "eval_" if split == "eval" else ""
        for name, values in self._metrics[split].items():
            if name != "loss" or split == "eval":
                logs[prefix + name] = sum(values) / len(values)
        self._metrics[split].clear()
        for extra in self.log_extras:
            logs.update(extra(split))
        super().log(logs, start_time)


class MetricsFile(TrainerCallback):
    """Append every log record (train and eval) to metrics.jsonl in the output directory, once per (step, kind):
    a resumed run does not repeat the records its checkpoint's run already wrote (`seen`)."""

    def __init__(self, path: Path, seen: set = frozenset()):
        self.path, self.seen = path, set(seen)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            record = {"step": state.global_step, "epoch": state.epoch, **logs}
            key = (state.global_step, "eval" if any(k.startswith("eval_") for k in logs) else "train")
            if key in self.seen:
                return
            self.seen.add(key)
            with writing(self.path):
                append_text(self.path, json.dumps(finite_or_null(record), allow_nan=False) + "\n")

    def append(self, record: dict) -> None:
        """A record of our own (`event`: kl_control, once per step; kl_alarm and kl_rollback, each as it happens;
        dpo/kl_governor.py)."""
        key = (record["step"], record["event"])
        if key in self.seen:
            return
        if record["event"] == "kl_control":
            self.seen.add(key)
        with writing(self.path):
            append_text(self.path, json.dumps(finite_or_null(record), allow_nan=False) + "\n")

    def truncate_after(self, step: int) -> None:
        """A KL rollback to the checkpoint of `step`: the records of the steps after it go (they are run again), the
        alarm records stay."""
        kept = [r for r in metrics_records(self.path)
                if r.get("step", 0) <= step or r.get("event") in ("kl_alarm", "kl_rollback")]
        data = "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8")
        with writing(self.path):
            atomic_write(self.path, lambda f: f.write(data))
        self.seen = {k for k in self.seen if k[0] <= step}


def finite_or_null(record: dict) -> dict:
    """A log record as JSON can hold it honestly: a NaN or infinite value is null (never 0.0, never a bare NaN
    token that strict JSON readers refuse)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


@dataclass(frozen=True)
class Panel:
    """One quantity against step: its title, y-axis label and series (metric key, legend name; "" for a panel of one
    series), train and eval."""

    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]
    ylim: tuple[float, float] | None = None


def _sides(prefix: str) -> tuple[tuple[str, str], ...]:
    return ((f"{prefix}/chosen", "chosen"), (f"{prefix}/rejected", "rejected"))


SHARE = (-0.03, 1.03)
PANELS = (
    Panel("loss", "loss", (("loss", ""),)),
    Panel("reward accuracy", "share of pairs with\nreward(chosen) > reward(rejected)", (("rewards/accuracies", ""),),
          SHARE),
    Panel("log-prob accuracy", "share of pairs with\nlog π(chosen) > log π(rejected)", (("logps/accuracies", ""),),
          SHARE),
    Panel("reward margin", "reward(chosen) − reward(rejected)\n(β · log-ratio, nats)", (("rewards/margins", ""),)),
    Panel("policy/reference log-ratio", "mean log(π / π_ref) per token (nats)", _sides("logratio")),
    Panel("learning rate", "learning rate", (("learning_rate", ""),)),
)
# with a top-k cache (dpo/losses.py): the KL bounds in both directions, and how tight they are
KL_PANELS = (
    Panel("KL(policy ‖ reference), top-k bound", "nats per token (a lower bound)", _sides("kl/policy_ref")),
    Panel("KL(reference ‖ policy), top-k bound", "nats per token (a lower bound)", _sides("kl/ref_policy")),
    Panel("reference's top-k mass", "probability (1: the KL bounds are exact)", _sides("ref_top_k_mass"), SHARE),
)
# with β governed (dpo/kl_governor.py): β, the KL it watches with the band shaded and alarms marked, the loss's parts
KL_WATCHED = "KL watched by the controller and alarms"
GOVERNOR_PANELS = (
    Panel("β (the governed coefficient)", "β", (("beta", ""),)),
    Panel(KL_WATCHED, "nats per token (a lower bound)", (("kl/measured", "measured"),)),
    Panel("the loss's parts", "per pair", (("loss/preference", "preference"), ("loss/kl_penalty", "KL penalty"),
                                           ("loss/sft", "SFT"), ("tdpo/kl_term", "TDPO KL term"))),
)
SPLITS = (("", "train", dict(linestyle="-")), ("eval_", "eval", dict(linestyle="--", marker="o", markersize=4)))
COLOURS = {"": ("tab:blue", "tab:orange"), "chosen": ("tab:green",) * 2, "rejected": ("tab:red",) * 2,
           "measured": ("tab:purple",) * 2, "preference": ("tab:blue",) * 2, "KL penalty": ("tab:purple",) * 2,
           "SFT": ("tab:brown",) * 2, "TDPO KL term": ("tab:olive",) * 2}


def metric_panels(records: list[dict]) -> tuple[Panel, ...]:
    """The plot's panels; the KL panels when the run logged the top-k KL metrics."""
    logged_kl = any(prefix + KL_PANELS[0].series[0][0] in r for r in records for prefix in ("", "eval_"))
    governed = any("beta" in r and "loss" in r for r in records)
    return (PANELS + KL_PANELS if logged_kl else PANELS) + (GOVERNOR_PANELS if governed else ())


def mark_kl_control(ax, records: list[dict]) -> None:
    """The watched KL's panel: the band shaded (or the target drawn), each alarm a dotted line at its step."""
    first = next((r for r in records if "loss" in r and ("kl/band_low" in r or "kl/target" in r)), None)
    if first and "kl/band_low" in first:
        ax.axhspan(first["kl/band_low"], first["kl/band_high"], color="tab:green", alpha=0.15, label="band")
    elif first:
        ax.axhline(first["kl/target"], color="tab:green", linestyle="--", label="target")
    for n, alarm in enumerate(r for r in records if r.get("event") == "kl_alarm"):
        ax.axvline(alarm["step"], color="tab:red", linestyle=":", label=None if n else "KL alarm")


def plot_title(run_name: str, loss_type: str, beta: float, learning_rate: float) -> str:
    return f"{run_name}: loss {loss_type}, β = {beta:g}, learning rate {learning_rate:g}"


def metrics_figure(records: list[dict], title: str):
    """A matplotlib Figure of the metrics against step, train and eval: one quantity per panel, each legend to the
    right of its panel (never over the curves), whole-number steps; each line's gid is its metric key."""
    # The object API with the Agg canvas: no pyplot state, no GUI backend probing
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = metric_panels(records)
    rows = len(panels) // 3
    fig = Figure(figsize=(16, 3.6 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    for ax, panel in zip(fig.subplots(rows, 3).flat, panels):
        for key, name in panel.series:
            for (prefix, split, style), colour in zip(SPLITS, COLOURS[name]):
                points = [(r["step"], r[prefix + key]) for r in records if r.get(prefix + key) is not None]
                if points:
                    ax.plot(*zip(*points), color=colour, label=f"{split}, {name}" if name else split,
                            gid=prefix + key, **style)
        if panel.title == KL_WATCHED:
            mark_kl_control(ax, records)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        if panel.ylim:
            ax.set_ylim(*panel.ylim)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines or ax.patches:
            ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    return fig


PNG_DPI = 90


def plot_metrics(metrics_path: Path, out_png: Path, title: str) -> None:
    """metrics.png of the run's metrics.jsonl (metrics_figure), as matplotlib's savefig writes it; written whole or
    not at all (atomic_write)."""
    fig = metrics_figure(metrics_records(metrics_path), title)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=PNG_DPI)
    atomic_write(out_png, lambda f: f.write(png.getvalue()))
