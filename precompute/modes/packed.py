"""packed: as shared_prompt, with several pairs per row (first-fit up to the longest pair; rows never see each
other), so short pairs fill what would be padding."""

from __future__ import annotations

from runtime.architecture import TREE_MASK_ATTENTION
from .shared_prompt import SharedPrompt


class Packed(SharedPrompt):
    name = "packed"
    description = "pairs packed into rows no longer than the longest pair, tree attention mask"
    packs = True

    def in_auto(self, attn):
        return attn in TREE_MASK_ATTENTION
