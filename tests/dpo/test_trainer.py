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
