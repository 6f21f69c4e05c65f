"""TRL's own DPOTrainer, trained against a verified refcache cache: `from dpo.trl import DPOTrainer`.

The class is TRL's `DPOTrainer` with its exact signature plus `ref_cache=` (a cache folder or URL) and
`eval_ref_cache=`. TRL stays in charge of everything (DPOConfig, its encoding and collator, losses, metrics,
callbacks, launchers, peft_config); only the one place where TRL obtains reference log-probs is replaced:
`_precompute_ref_logps`, which TRL calls for the train and eval datasets when `precompute_ref_log_probs` is on (it is
turned on here, so TRL neither loads nor runs a reference model). There, before a single cached value is used:

- the cache is opened by the one reader (schemas/cache.py: manifest, sizes, sha256, footers);
- the reference TRL would have used (`ref_model` if given, else the policy's starting weights, with peft_config the
  base) is hashed from its checkpoint folder, never run, and a model passed in memory must still hold that folder's
  weights; the tokenizer hash is the trainer's processing class's; DPOConfig's max_length and truncation_mode are
  the cache's;
- every row's token ids are the ones TRL itself produced (its tokenization, then its collator's truncation), and
  their mask checksum must equal the cached one; rows missing from the cache are refused by count.

All of it goes through train-dpo's rules (schemas/rules.py use_findings, dpo/verify.py check_values), so the messages
are train-dpo's. The sums TRL's loss reads are TRL's reduction of the cached per-token values (a plain sum, or with
`ld_alpha` the shared-length part plus ld_alpha times the rest). The reference is hashed in dpo/trl_reference.py,
TRL's rows are read in dpo/trl_rows.py.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from runtime.terminal import echo
from runtime import remedies
from runtime.errors import JobError

from .trl_reference import _folder_of, reference_hash
from .trl_rows import _after_final_eos, _row_ids, _skipped_by_the_cache, trl_rows

TRL_TESTED = ("1.16.0", "1.17")  # >= first, < second: the TRL versions whose private hooks this module was tested on
ROW = "refcache_row"
SECTION = "## Reference (refcache)"  # the index column added before TRL's processing, to find each processed row's original


def _check_trl():
    """TRL installed, at a version this module was tested against (its hooks are private and move)."""
    try:
        import trl
    except ImportError:
        raise ImportError("dpo.trl needs TRL: pip install 'refcache[trl]'") from None
    from packaging.version import Version

    low, high = TRL_TESTED
    if not Version(low) <= Version(trl.__version__) < Version(high):
        raise ImportError(f"dpo.trl is tested with trl>={low},<{high}; installed trl {trl.__version__}: install a "
                          f"version in that range (pip install 'trl>={low},<{high}') or train with train-dpo")
    return trl


_trl = _check_trl()


TRL_REMEDIES = {
    "model_hash": "pass the reference the cache was computed from (model, or ref_model), or re-run precompute-ref "
                  "with this model into a new --out",
    "tokenizer_hash": "pass the tokenizer the cache was made with (processing_class, including its chat template), "
                      "or re-run precompute-ref with this tokenizer into a new --out",
    "encoding": "set DPOConfig to the cache's value, or re-run precompute-ref with this value into a new --out",
}  # the row remedies (rows the cache lacks, rows edited) are runtime/remedies.py's, naming the cache


def _option(key: str) -> str:
    return f"DPOConfig.{key}"


class DPOTrainer(_trl.DPOTrainer):
    """TRL's DPOTrainer against a refcache cache: `ref_cache` (train rows) and `eval_ref_cache` (eval rows; defaults
    to `ref_cache`). Every other argument is TRL's."""

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, *, ref_cache, eval_ref_cache=None):
        if ref_cache is None:
            raise JobError("ref_cache= is required (a precompute-ref cache folder or URL); without a cache use "
                           "trl.DPOTrainer")
        for name, given in (("ref_cache", ref_cache), ("eval_ref_cache", eval_ref_cache)):
            if given is not None and (not isinstance(given, (str, os.PathLike)) or not str(given).strip()):
                raise TypeError(f"{name}= takes a precompute-ref cache folder or URL (a str or path), not "
                                f"{type(given).__name__} {given!r}")
        if args is None:  # as TRL names its default
            from trl.trainer.utils import get_config_model_id

            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = _trl.DPOConfig(f"{str(name).split('/')[-1]}-DPO")
        if args.sync_ref_model:
            raise JobError("DPOConfig.sync_ref_model moves the reference during training; a cache holds a fixed one")
        if isinstance(eval_dataset, dict):
            raise JobError("eval_dataset as a dict of datasets: pass one eval dataset with its eval_ref_cache")
        self._ref_folder, self._ref_hash = reference_hash(model, ref_model, peft_config)
        if processing_class is None:  # loaded here as TRL does, so that it is hashed before TRL sets a pad token
            from transformers import AutoProcessor

            processing_class = AutoProcessor.from_pretrained(_folder_of(model, "model"),
                                                             trust_remote_code=args.trust_remote_code)
        from schemas.stamps import tokenizer_hash, tokenizer_parts

        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self._tokenizer_stamp = tokenizer_hash(tokenizer), tokenizer_parts(tokenizer)
        self._caches = {"train": ref_cache, "eval": eval_ref_cache or ref_cache}
        self._row_names: dict[str, list[str]] = {}
        self._reports: dict[str, dict] = {}
        self._sums: dict[str, tuple[list[float], list[float]]] = {}
        self._given_collator = data_collator
        self._model_arg = model
        self._peft = peft_config is not None
        args.precompute_ref_log_probs = True  # TRL then loads no reference and asks _precompute_ref_logps for values
        super().__init__(model=model, ref_model=None, args=args, data_collator=data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         quantization_config=quantization_config, peft_config=peft_config)

    # TRL's hooks -------------------------------------------------------------------------------------------------

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """TRL's processing, then the verification of its rows against the cache (TRL calls this before its Trainer
        is built, so a refusal leaves nothing behind). Each row keeps its refcache id through TRL's processing, which
        may drop rows (keep_start drops a row whose prompt fills max_length)."""
        if ROW in dataset.column_names:  # processed here already (evaluate() passes it again)
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if "prompt_ids" in dataset.column_names:
            raise JobError(f"the {dataset_name} dataset is already tokenized (prompt_ids): its rows cannot be matched "
                           "to the cache's; pass the preference rows as text (prompt/chosen/rejected), as precompute-ref "
                           "read them")
        from datasets import IterableDataset

        from schemas.cache import open_cache

        from .verify import scanned_columns

        if isinstance(dataset, IterableDataset):
            raise JobError("an IterableDataset cannot be joined to a cache row by row; pass a map-style Dataset")
        cache = open_cache(self._caches["train" if dataset_name == "train" else "eval"], keep=scanned_columns)
        names = _row_ids(dataset, cache.encoding.columns)
        processed = super()._prepare_dataset(dataset.add_column(ROW, list(range(len(names)))), processing_class,
                                             args, dataset_name)
        names = [names[i] for i in processed[ROW]]
        self._row_names[dataset_name] = names
        self._sums[dataset_name] = self._verified_sums(cache, dataset_name, names,
                                                       trl_rows(processed, self._collator(args)), args)
        return processed

    def _collator(self, args):
        """The collator TRL will batch with (the one given, else TRL's own, built as TRL builds it): its
        truncation decides which tokens are scored."""
        if self._given_collator is not None:
            return self._given_collator
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        return DataCollatorForPreference(pad_token_id=self._tokenizer.pad_token_id, max_length=args.max_length,
                                         truncation_mode=args.truncation_mode,
                                         pad_to_multiple_of=args.pad_to_multiple_of)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """The reference sums TRL's loss reads, from the verified cache; no reference model, no forward."""
        if "ref_chosen_logps" in dataset.column_names and ROW in dataset.column_names:  # joined here already
            return dataset
        sums = self._sums.get(name)
        if sums is None or len(sums[0]) != len(dataset):
            raise JobError(f"the {name} dataset was not processed by this trainer; pass it to DPOTrainer")
        return dataset.add_column("ref_chosen_logps", sums[0]).add_column("ref_rejected_logps", sums[1])

    def _verified_sums(self, cache, name: str, ids: list[str], rows, args) -> tuple[list[float], list[float]]:
        import time

        import torch

        from schemas.encoding import row_mask_checksum
        from schemas.rules import use_findings

        from .verify import check_values

        t0 = time.perf_counter()
        checks = {rid: row_mask_checksum(*row) for rid, row in zip(ids, rows)}
        request = {"max_length": args.max_length, "truncation_mode": args.truncation_mode}
        for finding in use_findings(cache, model_hash=self._ref_hash, tokenizer_hash=self._tokenizer_stamp[0],
                                    tokenizer_parts=self._tokenizer_stamp[1], encoding_request=request,
                                    rows=lambda _encoding: checks, option=_option,
                                    remedies={**TRL_REMEDIES, **remedies.trl_rows(cache.root)}):
            if finding.kind == "mask_checksum":
                self._refuse_post_eos(cache, ids, rows)
            error = finding.error()
            raise (_skipped_by_the_cache(error, cache, checks) if finding.kind == "rows_missing" else error) from None
        values = check_values(cache, ids)  # train-dpo's value rules, the per-token columns as ref_<column>
        chosen, rejected = values.column("ref_chosen_logps").to_pylist(), values.column("ref_rejected_logps").to_pylist()
        alpha = args.ld_alpha
        sums = ([], [])
        for c, r in zip(chosen, rejected):
            c, r = torch.tensor(c, dtype=torch.float32), torch.tensor(r, dtype=torch.float32)
            if alpha is None:  # TRL's reduction of per-token values (DPOTrainer._compute_loss)
                sums[0].append(c.sum().item())
                sums[1].append(r.sum().item())
            else:
                shared = min(len(c), len(r))
                sums[0].append((c[:shared].sum() + alpha * c[shared:].sum()).item())
                sums[1].append((r[:shared].sum() + alpha * r[shared:].sum()).item())
        self._reports[name] = {"cache": str(cache.root), "rows": len(ids), "file_hashes": "sha256 checked",
                               "total_s": round(time.perf_counter() - t0, 3), "stamps": cache.stamps,
                               "dtype": (cache.manifest.get("computation") or {}).get("dtype"),
                               "encoding": "TRL's (ids from DPOTrainer's tokenization and collator)"}
        if args.process_index == 0:
            echo(f"verified {cache.root}: {len(ids)} {name} rows, model/tokenizer/mask stamps match TRL's "
                  f"({self._reports[name]['total_s']:.2f} s)")
        return sums

    def _refuse_post_eos(self, cache, ids, rows) -> None:
        """A conversational row whose ids differ from the cache's only by what the chat template writes after the
        completion's final EOS: TRL scores those tokens, refcache's encoding ends the completion at that EOS."""
        from schemas.encoding import row_mask_checksum

        cached = dict(zip(cache.index.column("id").to_pylist(), cache.index.column("mask_checksum").to_pylist()))
        eos = self._tokenizer.eos_token_id
        for rid, (prompt, chosen, rejected) in zip(ids, rows):
            tail = _after_final_eos(chosen, eos)
            cut = (chosen[:len(chosen) - len(tail)], rejected[:len(rejected) - len(_after_final_eos(rejected, eos))])
            if cached.get(rid) not in (None, row_mask_checksum(prompt, chosen, rejected)) and tail and \
                    cached[rid] == row_mask_checksum(prompt, *cut):
                raise JobError(
                    f"row {rid!r}: TRL scores {len(tail)} token(s) the chat template writes after the completion's "
                    f"final EOS ({self._tokenizer.decode(tail)!r}), and the cache {cache.root} ends each completion at "
                    "that EOS (refcache's encoding, completion_end eos), so its reference sums would not be TRL's; "
                    "make the cache in TRL's encoding: precompute-ref --completion-end template into a new --out")

    # provenance ----------------------------------------------------------------------------------------------------

    def reference_record(self) -> dict:
        """What this run was trained against, as train-dpo records it (schemas/run_manifest.py)."""
        from schemas import run_manifest as rm

        train = self._reports.get("train")
        evaluation = next((r for k, r in self._reports.items() if k != "train"), None)
        return rm.reference_record(
            train_cache=rm.cache_record(self._caches["train"], train["stamps"]) if train else None,
            eval_cache=rm.cache_record(self._caches["eval"], evaluation["stamps"]) if evaluation else None,
            live_model=None, data_fingerprint=self._fingerprint("train"),
            eval_data_fingerprint=self._fingerprint("eval") if evaluation else None)

    def _fingerprint(self, name: str) -> str | None:
        """The fingerprint of the rows trained on: their ids and mask checksums (the same rows give the same one)."""
        import hashlib

        ids = self._row_names.get(name)
        return None if ids is None else "sha256:" + hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()[:32]

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.is_world_process_zero():
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            from .provenance import record_in

            folder = Path(self._get_output_dir(trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            if folder.is_dir():
                record_in(folder, self.reference_record())

    def save_model(self, output_dir=None, _internal_call=False):
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.is_world_process_zero():
            self.write_provenance(Path(output_dir or self.args.output_dir))

    def write_provenance(self, out: Path) -> dict:
        """run-manifest.json (train-dpo's format: the caches' cache_id, manifest sha256 and stamps) and the model
        card's reference section, in the folder the model was saved to; `audit-ref CACHE --run OUT` audits it."""
        from runtime.checkpoint import software_versions
        from schemas import run_manifest as rm
        from schemas.stamps import adapter_config_fingerprint, adapter_hash, model_hash

        from .card import CARD

        record = self.reference_record()
        peft = None
        if self._peft:
            peft = {"base_model_hash": self._ref_hash, "reference_model_hash": self._ref_hash,
                    "final_adapter_hash": adapter_hash(out), "adapter_config": adapter_config_fingerprint(out),
                    "merged_model_hash": None, "init_adapter": None, "options": {}}
        steps = self.state.global_step
        manifest = rm.build_run_manifest(
            reference=record | {"verification": self._reports.get("train")},
            initial_model=self._initial_model(),
            data={"fingerprint": record["data_fingerprint"], "rows": len(self._row_names.get("train", []))},
            eval_data={"fingerprint": record["eval_data_fingerprint"]} if record["eval_data_fingerprint"] else None,
            config={"trainer": "trl.DPOTrainer (dpo.trl)", "training_args": json.loads(self.args.to_json_string())},
            software=software_versions() | {"trl": _trl.__version__},
            result={"steps": steps, "world_size": self.args.world_size},
            final_model_hash=None if peft else model_hash(out),
            finished_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **({"peft": peft} if peft else {}))
        rm.write_json(out / rm.RUN_MANIFEST, manifest)
        self._manifest = manifest
        if out.resolve() == Path(self.args.output_dir).resolve():
            self.create_model_card(model_name=out.name)  # TRL's card, with the reference section (create_model_card)
        else:
            self._add_reference_section(out / CARD)
        return manifest

    def _initial_model(self) -> dict:
        """The policy's starting checkpoint: the reference's folder unless ref_model named another one."""
        from schemas.stamps import model_hash

        folder = _folder_of(self._model_arg, "model")
        same = Path(folder).resolve() == Path(self._ref_folder).resolve()
        return {"path": folder, "model_hash": self._ref_hash if same else model_hash(folder)}

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card, and after it train-dpo's reference section (once the run has a manifest)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero() and getattr(self, "_manifest", None):
            from .card import CARD

            self._add_reference_section(Path(self.args.output_dir) / CARD)

    def _add_reference_section(self, card: Path) -> None:
        from storage.files import atomic_write

        from .card import reference_section

        text = card.read_text(encoding="utf-8") if card.is_file() and not card.is_symlink() else ""
        text = text.split(SECTION)[0].rstrip("\n")
        section = f"{SECTION}\n\n{reference_section(self._manifest['reference'], self._manifest.get('peft'))}\n"
        data = ((text + "\n\n" if text else "") + section).encode("utf-8")
        atomic_write(card, lambda f: f.write(data))
