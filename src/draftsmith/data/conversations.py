"""Which conversation a record belongs to: the one grouping every held-out split uses (train's
held-out samples, evaluate's prompts from a training source, the bench scripts), so no part of a
held-out conversation is ever trained on.

    conversation_keys(source_ids, sample_index) -> each sample's conversation (ShareGPT parts joined)
    conversation_of(source_id, keys)            -> the key of `keys` that source_id belongs to, or None
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Collection, Hashable, Optional, Sequence

# ShareGPT cuts a long conversation into records `<id>_<turn>` (`QWJhYvA_0`, `QWJhYvA_11`); the
# builtin file has up to 89 parts per conversation. A stem shared by more records than this (or by
# more than half of them) is a naming scheme (`sample_0`, `sample_1`, ...), not one conversation.
SHAREGPT_PART = re.compile(r"_\d+$")
MAX_PARTS = 256


def stem(source_id: str) -> str:
    """A record id without its ShareGPT part suffix (`abc_3` -> `abc`)."""
    return SHAREGPT_PART.sub("", source_id)


def conversation_keys(source_ids: Sequence[Optional[str]], sample_index: Sequence[int]) -> list[Hashable]:
    """Each sample's conversation, the unit a held-out split keeps whole: the stem of its source
    id (ShareGPT's parts `abc_0`, `abc_1` of one long conversation share the stem `abc`), except
    for a stem shared by more than MAX_PARTS samples or by more than half of them (a naming scheme:
    those keep their whole ids). Samples of shards written without source ids: their record index."""
    if not source_ids or any(i is None for i in source_ids):
        return list(sample_index)
    stems = [stem(i) for i in source_ids]
    parts = Counter(stems)
    return [s if parts[s] <= MAX_PARTS and 2 * parts[s] <= len(stems) else i for s, i in zip(stems, source_ids)]


def conversation_of(source_id: str, keys: Collection[Hashable]) -> Optional[Hashable]:
    """The conversation of `keys` (conversation_keys of some samples) that the record `source_id`
    is part of: its whole id or its stem, whichever is a key; None when it is part of none."""
    if source_id in keys:
        return source_id
    s = stem(source_id)
    return s if s != source_id and s in keys else None
