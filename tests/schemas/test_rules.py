"""The rule book itself (schemas/rules.py): every rule run over a small cache and a caller that matches it finds
nothing; each damage, and each difference between the cache and its caller, is found by its own rule (rule and
kind) and by no other (the caller's comparisons run on a sound cache, as a reader refuses a damaged one first).
Damage that two rules see by their nature (a shard named outside the cache leaves its real file unlisted) names
both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import format as fmt
from schemas import rule_top_k, rules
from schemas.card import dataset_card, write_card
from schemas.encoding import EncodingConfig, row_mask_checksum
from schemas.stamps import combined_mask_checksum
from storage.reads import file_sha256

ENC = EncodingConfig(max_length=64)
COMP = {"dtype": "float32", "device_type": "cpu", "mode": "single"}
MODEL, TOKENIZER = "m" * 64, "t" * 64
SHARDS, PER_SHARD = 2, 3


def rows_of(n: int = SHARDS * PER_SHARD) -> list[dict]:
    out = []
    for i in range(n):
        prompt, chosen, rejected = [1, 2, 3 + i], [4 + i, 5], [6, 7 + i, 8]
        out.append({"id": f"r{i}", "prompt": prompt, "chosen": chosen, "rejected": rejected,
                    "chosen_logps": [-0.5, -1.0 - i], "rejected_logps": [-0.25, -2.0, -0.125 * i],
                    "checksum": row_mask_checksum(prompt, chosen, rejected)})
    return out


def table_of(rows) -> pa.Table:
    return fmt.shard_table([r["id"] for r in rows], [r["prompt"] for r in rows], [r["chosen"] for r in rows],
                           [r["rejected"] for r in rows], [r["chosen_logps"] for r in rows],
                           [r["rejected_logps"] for r in rows])


def write_shard(root: Path, name: str, table: pa.Table, **stamps) -> dict:
    return fmt.write_shard(root / name, table, model_hash=stamps.get("model_hash", MODEL),
                           tokenizer_hash=stamps.get("tokenizer_hash", TOKENIZER), encoding=ENC, computation=COMP)


def restamp(root: Path, manifest: dict) -> None:
    """The manifest's cache checksum recomputed from the shards, as a forger who knows the format would."""
    checks = [c for e in manifest["shards"]
              for c in pq.read_table(root / e["file"], columns=["mask_checksum"]).column(0).to_pylist()]
    manifest["stamps"]["mask_checksum"] = combined_mask_checksum(checks, ENC.to_json())
    fmt.write_manifest(root, manifest)


def write_cache(root: Path, rows, shard=table_of, computation=COMP) -> dict:
    """A sound cache of `rows` (`shard`: how a shard's table is built, e.g. top_k_shard with COMP_K)."""
    root.mkdir(parents=True)
    entries = [fmt.write_shard(root / f"shard-{i:05d}.parquet", shard(rows[i * PER_SHARD:(i + 1) * PER_SHARD]),
                               model_hash=MODEL, tokenizer_hash=TOKENIZER, encoding=ENC, computation=computation)
               for i in range(SHARDS)]
    manifest = {"format_version": fmt.FORMAT_VERSION, "stamps": {"model_hash": MODEL, "tokenizer_hash": TOKENIZER},
                "encoding": ENC.to_dict(), "computation": computation, "shards": entries, "rows": len(rows),
                "source": {"rows_in": len(rows), "skipped": 0, "skipped_by_reason": {}}}
    restamp(root, manifest)
    return manifest


VOCAB, K = 16, 4
COMP_K = {**COMP, "top_k": K}
TOP_K_TYPES = {"top_ids": pa.list_(pa.list_(pa.int32())), "top_logps": pa.list_(pa.list_(pa.float32())),
               "tail": pa.list_(pa.float32())}


def top_k_of(token: int, logp: float) -> tuple[list, list, float]:
    """A distribution over VOCAB ids in which `token` has log-prob `logp` and the others share the rest equally:
    its K most probable ids (ties by id), their log-probs and the log of the rest, in float64."""
    p = np.full(VOCAB, (1 - np.exp(logp)) / (VOCAB - 1))
    p[token] = np.exp(logp)
    order = np.argsort(-p, kind="stable")
    with np.errstate(divide="ignore"):
        return order[:K].tolist(), np.log(p[order[:K]]).tolist(), float(np.log(p[order[K:]].sum()))


def top_k_table(rows, edit=None, scored=None) -> pa.Table:
    """table_of(rows) with the top-k columns of `top_k_of` for each token (of `scored` rows' log-probs when given:
    the cached log-probs then differ from those the top-k came from); `edit(columns)` damages them."""
    table = table_of(rows)
    columns = {f"{side}_{s}": [] for side in ("chosen", "rejected") for s in rules.TOP_K_COLUMNS}
    for r in scored or rows:
        for side in ("chosen", "rejected"):
            top = [top_k_of(t, lp) for t, lp in zip(r[side], r[f"{side}_logps"])]
            for n, suffix in enumerate(rules.TOP_K_COLUMNS):
                columns[f"{side}_{suffix}"].append([t[n] for t in top])
    (edit or (lambda c: None))(columns)
    for name, values in columns.items():
        kind = TOP_K_TYPES[name.split("_", 1)[1]]
        table = table.append_column(pa.field(name, kind), pa.array(values, kind))
    return table


def top_k_shard(rows, edit=None, scored=None) -> pa.Table:
    """top_k_table's rows as the writer stores them (fmt.shard_table with K: the top-k columns in their storage
    encoding), as a forger who knows the format would write them; only damage the storage can hold."""
    logical = top_k_table(rows, edit, scored)
    scores = {side: [fmt.TokenScores(logps=r[f"{side}_logps"],
                                     **{s: np.asarray(logical[f"{side}_{s}"][i].as_py()) for s in rules.TOP_K_COLUMNS})
                     for i, r in enumerate(rows)] for side in ("chosen", "rejected")}
    return fmt.shard_table([r["id"] for r in rows], [r["prompt"] for r in rows], [r["chosen"] for r in rows],
                           [r["rejected"] for r in rows], scores["chosen"], scores["rejected"], top_k=K)


def write_top_k_cache(root: Path, rows) -> dict:
    return write_cache(root, rows, top_k_shard, COMP_K)


def every_rule(root: Path, caller: dict) -> set[tuple[str, str]]:
    """(rule, kind) of every finding of every rule, run the way audit-ref runs them (a shard failing shard_files is
    left out of the row rules; the cache checksum waits for every shard), then a sound cache against `caller`."""
    manifest = fmt.read_manifest(root)
    found = list(rules.manifest_findings(manifest))
    frames, every, ids_by_shard = [], [], []
    for entry in manifest["shards"]:
        path, problems = rules.shard_file_findings(root, entry)
        if not problems:
            want = rules.expected_footer(manifest["stamps"], ENC, entry, manifest.get("computation"))
            problems = rules.shard_footer_findings(path, want, entry["rows"])[1]
        found += problems
        if any(f.rule == "shard_files" for f in problems):
            continue
        table = fmt.read_columns(path).replace_schema_metadata(None)  # logical types, as audit-ref reads them
        found += rules.shard_checksum_findings(entry["file"], entry, table.column("mask_checksum").to_pylist(),
                                               table.column("id").to_pylist(), ENC.to_json())
        import polars as pl

        df = pl.from_arrow(table).with_row_index("row").with_columns(pl.lit(entry["file"]).alias("shard"))
        found += rules.row_checksum_findings(df, entry["file"]) + rules.value_findings(df, entry["file"])
        k = fmt.top_k_of(rules.footer_computation(fmt.read_footer(path).meta))
        found += rules.top_k_findings(df, k, VOCAB, entry["file"]) if k else []
        frames.append(table.append_column("shard", pa.array([entry["file"]] * table.num_rows))
                      .append_column("row", pa.array(range(table.num_rows), pa.uint32())))
        every += table.column("mask_checksum").to_pylist()
        ids_by_shard.append((entry["file"], table.column("id").to_pylist()))
    found += rules.unlisted_findings(root, [e["file"] for e in manifest["shards"]])
    found += rules.unique_id_findings(ids_by_shard)
    if len(frames) == len(manifest["shards"]) and not any(f.rule == "shard_checksums" for f in found):
        found += rules.cache_checksum_findings(every, manifest)
    found += rules.skipped_findings(root, manifest)[1]
    if not found:  # the card is compared with a sound manifest (audit-ref's card check waits for the others)
        found += rules.card_findings(root, manifest)[1]
    if found:  # a reader refuses the cache before it compares it with its caller
        return {(f.rule, f.kind) for f in found}
    found += rules.computation_findings(manifest["computation"], caller["computation"])
    index = pa.concat_tables(frames).select(["id", "mask_checksum", "shard", "row"])
    cache = SimpleNamespace(root=root, manifest=manifest, stamps=manifest["stamps"], encoding=ENC, index=index)
    found += rules.use_findings(cache, model_hash=caller["model_hash"], tokenizer_hash=caller["tokenizer_hash"],
                                encoding_request=caller["encoding"], rows=lambda encoding: caller["rows"])
    return {(f.rule, f.kind) for f in found}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rules") / "cache"
    write_cache(root, rows_of())
    return root


def matching_caller() -> dict:
    return {"model_hash": MODEL, "tokenizer_hash": TOKENIZER, "encoding": {"max_length": None}, "computation": COMP,
            "rows": {r["id"]: r["checksum"] for r in rows_of()}}


def shard_rewritten(edit):
    """Damage: shard 1 rewritten with `edit(rows) -> table`, its manifest entry and the cache checksum made to match
    (only the rule that reads the edited thing can see it)."""
    def damage(root, manifest, caller):
        name = manifest["shards"][1]["file"]
        manifest["shards"][1] = write_shard(root, name, edit(rows_of()[PER_SHARD:2 * PER_SHARD]))
        restamp(root, manifest)
    return damage


def footer_rewritten(edit_table=None, edit_meta=None):
    """Damage: shard 0 written again by hand, keeping (or editing) its footer metadata; the entry's bytes and sha256
    made to match."""
    def damage(root, manifest, caller):
        entry = manifest["shards"][0]
        path = root / entry["file"]
        table = pq.read_table(path)
        meta = dict(table.schema.metadata)
        table = (edit_table or (lambda t: t))(table.replace_schema_metadata(None))
        pq.write_table(table.replace_schema_metadata((edit_meta or (lambda m: m))(meta)), path)
        entry.update(bytes=path.stat().st_size, sha256=file_sha256(path))
        fmt.write_manifest(root, manifest)
    return damage


def manifest_edit(edit):
    def damage(root, manifest, caller):
        edit(manifest)
        fmt.write_manifest(root, manifest)
    return damage


def caller_edit(edit):
    def damage(root, manifest, caller):
        edit(caller)
    return damage


def with_column(table: pa.Table, name: str, values) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def swap_rows(table: pa.Table) -> pa.Table:
    return table.take([1, 0, *range(2, table.num_rows)])


def flip_byte(root, manifest, caller):
    path = root / manifest["shards"][0]["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def positive(rows):
    rows[0]["chosen_logps"] = [0.5, -1.0]
    return table_of(rows)


def short_list(rows):
    rows[0]["chosen_logps"] = rows[0]["chosen_logps"][:1]
    return table_of(rows)


def other_checksum(rows):
    t = table_of(rows)
    return with_column(t, "mask_checksum", ["0" * 64] + t.column("mask_checksum").to_pylist()[1:])


def skipped_line(root, manifest, caller):
    (root / fmt.SKIPPED).write_text(json.dumps({"id": "x", "reason": "too_long"}) + "\n")


def card_edited(edit):
    """Damage: the cache's dataset card written for its manifest, then `edit(card)` (huggingface_hub's card API)."""
    def damage(root, manifest, caller):
        card = dataset_card(manifest)
        edit(card)
        card.save(root / fmt.CARD)
    return damage


def duplicate_id(root, manifest, caller):
    rows = rows_of()
    rows[PER_SHARD]["id"] = rows[0]["id"]
    for p in root.iterdir():
        p.unlink()
    root.rmdir()
    manifest.clear()
    manifest.update(write_cache(root, rows))
    caller["rows"] = {r["id"]: r["checksum"] for r in rows}


CASES = {  # name: (damage, the findings it must produce, and no other)
    "manifest rows": (manifest_edit(lambda m: (m.update(rows=m["rows"] + 1), m["source"].update(rows_in=m["rows"]))),
                      {("manifest", "manifest")}),
    "shard missing": (lambda root, m, c: (root / m["shards"][1]["file"]).unlink(), {("shard_files", "shard_missing")}),
    "shard size": (manifest_edit(lambda m: m["shards"][0].update(bytes=m["shards"][0]["bytes"] + 1)),
                   {("shard_files", "shard_size")}),
    "shard hash": (flip_byte, {("shard_files", "shard_hash")}),
    "shard name": (manifest_edit(lambda m: m["shards"][0].update(file="../elsewhere.parquet")),
                   {("shard_files", "shard_path"), ("shard_files", "shard_unlisted")}),  # shard-00000 now unlisted
    "shard unlisted": (lambda root, m, c: shutil.copy(root / m["shards"][0]["file"], root / "extra.parquet"),
                       {("shard_files", "shard_unlisted")}),
    "shard rows": (manifest_edit(lambda m: (m["shards"][0].update(rows=m["shards"][0]["rows"] + 1),
                                            m.update(rows=m["rows"] + 1), m["source"].update(rows_in=m["rows"]))),
                   {("shard_files", "shard_rows")}),
    "footer model hash": (footer_rewritten(edit_meta=lambda m: {**m, b"refcache.model_hash": b"other"}),
                          {("shard_stamps", "model_hash")}),
    "footer computation": (footer_rewritten(edit_meta=lambda m: {**m, b"refcache.computation": b'{"dtype": "x"}'}),
                           {("shard_stamps", "computation")}),
    "rows reordered": (footer_rewritten(edit_table=swap_rows),
                       {("shard_checksums", "mask_checksum"), ("shard_checksums", "ids_checksum")}),
    "stored row checksum": (shard_rewritten(other_checksum), {("row_checksums", "mask_checksum")}),
    "cache checksum": (manifest_edit(lambda m: m["stamps"].update(mask_checksum="0" * 64)),
                       {("cache_checksum", "mask_checksum")}),
    "duplicate id": (duplicate_id, {("unique_ids", "duplicate_id")}),
    "list length": (shard_rewritten(short_list), {("list_lengths", "values")}),
    "sum": (shard_rewritten(lambda rows: with_column(table_of(rows), "chosen_logp", [0.0] * len(rows))),
            {("sums", "values")}),
    "positive log-prob": (shard_rewritten(positive), {("logprob_values", "values")}),
    "skipped list": (skipped_line, {("skipped_counts", "manifest")}),
    "card of other stamps": (card_edited(lambda c: c.data.refcache["stamps"].update(model_hash="0" * 64)),
                             {("card", "card")}),
    "card naming a shard less": (card_edited(lambda c: c.data.configs[0]["data_files"][0]["path"].pop()),
                                 {("card", "card")}),
    "card unreadable": (lambda root, m, c: (root / fmt.CARD).write_bytes(b"---\n[not: yaml\n---\n"),
                        {("card", "card")}),
    "caller computation": (caller_edit(lambda c: c.update(computation={**COMP, "dtype": "bfloat16"})),
                           {("computation", "computation")}),
    "caller model": (caller_edit(lambda c: c.update(model_hash="x" * 64)), {("stamps", "model_hash")}),
    "caller tokenizer": (caller_edit(lambda c: c.update(tokenizer_hash="x" * 64)), {("stamps", "tokenizer_hash")}),
    "caller encoding option": (caller_edit(lambda c: c.update(encoding={"max_length": 32})), {("stamps", "encoding")}),
    "caller row missing": (caller_edit(lambda c: c["rows"].update({"new": "0" * 64})), {("rows", "rows_missing")}),
    "caller row differs": (caller_edit(lambda c: c["rows"].update(r1="0" * 64)), {("rows", "mask_checksum")}),
}


def test_a_sound_cache_and_its_caller_find_nothing(pristine, tmp_path):
    assert every_rule(pristine, matching_caller()) == set()
    root = Path(shutil.copytree(pristine, tmp_path / "cache"))
    assert write_card(root, fmt.read_manifest(root))  # with its card, or a card with free metadata added to it
    assert every_rule(root, matching_caller()) == set()
    card_edited(lambda c: (setattr(c.data, "license", "mit"), setattr(c, "text", "mine")))(
        root, fmt.read_manifest(root), None)
    assert every_rule(root, matching_caller()) == set()


@pytest.mark.parametrize("case", CASES)
def test_each_rule_fires_on_its_case_and_only_there(pristine, tmp_path, case):
    damage, expected = CASES[case]
    root = Path(shutil.copytree(pristine, tmp_path / "cache"))
    caller = matching_caller()
    damage(root, fmt.read_manifest(root), caller)
    assert every_rule(root, caller) == expected


# ---------------------------------------------------------------------------------------------------------------
# a top-k cache (precompute-ref --top-k K): the top-k rules, each damage found by its own


def top_k_rewritten(edit=None, scored=None):
    """Damage: shard 1 of a top-k cache rewritten with its top-k columns edited (or its cached log-probs moved by
    `scored(rows)`, the top-k kept), the entry and the cache checksum made to match."""
    def damage(root, manifest, caller):
        rows = rows_of()[PER_SHARD:2 * PER_SHARD]
        moved = [dict(r, chosen_logps=list(r["chosen_logps"])) for r in rows]
        (scored or (lambda rows: None))(moved)
        name = manifest["shards"][1]["file"]
        manifest["shards"][1] = fmt.write_shard(root / name, top_k_shard(moved, edit, scored=rows), model_hash=MODEL,
                                                tokenizer_hash=TOKENIZER, encoding=ENC, computation=COMP_K)
        restamp(root, manifest)
    return damage


def _set(column: str, row: int, token: int, rank: int | None, value):
    def edit(columns):
        if rank is None:
            columns[column][row][token] = value
        else:
            columns[column][row][token][rank] = value
    return edit


def _swap_first_two(columns):
    for name in ("chosen_top_ids", "chosen_top_logps"):
        values = columns[name][0][0]
        values[0], values[1] = values[1], values[0]


def _chosen_logp(row: int, token: int, value: float):
    return lambda rows: rows[row]["chosen_logps"].__setitem__(token, value)


# rows 3..5 are shard 1's; row 3's chosen tokens [7, 5] have log-probs [-0.5, -4.0]: the first is the most
# probable of the VOCAB ids, the second (the others share 1 - e^-4 equally, -2.726 each) outside the top K
TOP_K_CASES = {
    "top-k id outside the vocabulary": (top_k_rewritten(_set("chosen_top_ids", 0, 0, 1, VOCAB)),
                                        {("top_k_ids", "top_k")}),
    "top-k id twice": (top_k_rewritten(_set("rejected_top_ids", 1, 0, 2, 6)), {("top_k_ids", "top_k")}),
    "top-k unsorted": (top_k_rewritten(_swap_first_two), {("top_k_order", "top_k")}),
    "top-k mass": (top_k_rewritten(_set("rejected_tail", 2, 1, None, -0.5)), {("top_k_mass", "top_k")}),
    "top-k dataset entry differs": (top_k_rewritten(scored=_chosen_logp(0, 0, -0.51)), {("top_k_dataset", "top_k")}),
    "top-k dataset above the k-th": (top_k_rewritten(scored=_chosen_logp(0, 1, -2.5)), {("top_k_dataset", "top_k")}),
}


# damage the storage cannot hold (its codes clamp a log-prob above 0 to 0, and a column without K values per
# token does not read back: read_columns refuses it), judged where a reader hands the rules a table
TOP_K_TABLE_CASES = {
    "top-k positive log-prob": (_set("chosen_top_logps", 0, 1, 0, 0.25), {("top_k_order", "top_k")}),
    "top-k entry missing": (_set("chosen_top_logps", 0, 0, None, [-0.5, -3.0, -3.0]), {("top_k_shape", "top_k")}),
}


@pytest.mark.parametrize("case", TOP_K_TABLE_CASES)
def test_each_top_k_rule_the_storage_cannot_hold_fires_on_its_table_case(case):
    edit, expected = TOP_K_TABLE_CASES[case]
    rows = rows_of()[PER_SHARD:2 * PER_SHARD]
    assert {(f.rule, f.kind) for f in rules.top_k_findings(top_k_table(rows, edit), K, VOCAB, "s")} == expected
    assert rules.top_k_findings(top_k_table(rows), K, VOCAB, "s") == []


@pytest.fixture(scope="module")
def pristine_top_k(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rules-top-k") / "cache"
    write_top_k_cache(root, rows_of())
    return root


def test_a_sound_top_k_cache_and_its_caller_find_nothing(pristine_top_k):
    table = fmt.read_columns(pristine_top_k / "shard-00001.parquet")
    assert table["chosen_top_ids"][0].as_py() == [[7, 0, 1, 2], [0, 1, 2, 3]]  # token 7 first; token 5 not among K
    assert every_rule(pristine_top_k, {**matching_caller(), "computation": COMP_K}) == set()


@pytest.mark.parametrize("case", TOP_K_CASES)
def test_each_top_k_rule_fires_on_its_case_and_only_there(pristine_top_k, tmp_path, case):
    damage, expected = TOP_K_CASES[case]
    root = Path(shutil.copytree(pristine_top_k, tmp_path / "cache"))
    caller = {**matching_caller(), "computation": COMP_K}
    damage(root, fmt.read_manifest(root), caller)
    assert every_rule(root, caller) == expected


def test_top_k_findings_name_the_row_the_position_and_the_count():
    rows = rows_of()[PER_SHARD:2 * PER_SHARD]
    table = top_k_table(rows, lambda c: (_set("chosen_top_ids", 2, 1, 3, -1)(c), _set("chosen_top_ids", 1, 0, 0, 99)(c)))
    (f,) = rules.top_k_findings(table, K, VOCAB, "s.parquet")
    assert (f.rule, f.kind, f.shard, f.row, f.count) == ("top_k_ids", "top_k", "s.parquet", 1, 2)
    assert f.message == "top-k columns of row 'r4' are inconsistent: the cache was edited or damaged [top_k_ids: " \
        "chosen token 0: id 99 outside 0..15]"
    (f,) = rules.top_k_findings(table, "8", VOCAB, "s.parquet")  # a K that is not a count
    assert (f.rule, f.count) == ("top_k_shape", 3) and "computation.top_k is '8'" in f.message
    assert rules.top_k_findings(top_k_table(rows), K, None) == []  # no vocabulary known: ids only >= 0


def test_top_k_findings_are_the_same_judged_a_few_rows_at_a_time(monkeypatch):
    rows = rows_of()
    def damage(columns):
        _set("chosen_top_ids", 4, 1, 3, -1)(columns)
        _set("rejected_tail", 1, 0, None, 0.5)(columns)
        columns["chosen_tail"][5] = columns["chosen_tail"][5][:1]  # one tail for two tokens
        _set("rejected_tail", 3, 2, None, -3)(columns)
    table = top_k_table(rows, damage)
    whole = rules.top_k_findings(table, K, VOCAB, "s")
    assert {f.rule: (f.row, f.count) for f in whole} == {"top_k_shape": (5, 1), "top_k_ids": (4, 1),
                                                         "top_k_order": (1, 1), "top_k_mass": (3, 1)}
    monkeypatch.setattr(rule_top_k, "TOP_K_CHUNK", 2 * K)  # one or two rows at a time
    assert rules.top_k_findings(table, K, VOCAB, "s") == whole


def test_top_k_values_rounded_as_the_storage_may_round_them_pass():
    """Every top-k log-prob moved down by 2**-12 x max(1, |v|) (the bound FORMAT.md gives its storage; the move
    keeps the order): no finding. Four times that is the allowance, so the move itself is not what passes."""
    def rounded(columns):
        for side in ("chosen", "rejected"):
            columns[f"{side}_top_logps"] = [[[v - 2**-12 * max(1.0, abs(v)) for v in position] for position in row]
                                            for row in columns[f"{side}_top_logps"]]
    assert rules.top_k_findings(top_k_table(rows_of(), rounded), K, VOCAB) == []
    assert float(rules.top_k_allowance(-30.0)) == pytest.approx(0.03) and rules.top_k_allowance(-np.inf) == 0


def test_every_rule_has_a_case():
    """A rule added to the book without a case here fails (rules as audit-ref and train-dpo name them)."""
    covered = {rule for _, expected in (*CASES.values(), *TOP_K_CASES.values(), *TOP_K_TABLE_CASES.values())
               for rule, _ in expected}
    assert covered == {"manifest", "shard_files", "shard_stamps", "shard_checksums", "row_checksums", "cache_checksum",
                       "unique_ids", *rules.VALUE_RULES, *rules.TOP_K_RULES, "skipped_counts", "card", "computation",
                       "stamps", "rows"}


# ---------------------------------------------------------------------------------------------------------------
# the comparisons with a caller, one by one: what each finding says


def test_stamp_findings_name_the_stamp_and_carry_the_callers_remedy():
    recorded = {"model_hash": MODEL, "tokenizer_hash": TOKENIZER,
                "tokenizer": {"parts": {"vocab": "a", "chat_template": "b"}}}
    (f,) = rules.stamp_findings(recorded, {"model_hash": "x", "tokenizer_hash": TOKENIZER}, where="the cache /c",
                                remedies={"model_hash": "pass --ref-model"})
    assert (f.kind, f.expected, f.found, f.remedy) == ("model_hash", "x", MODEL, "pass --ref-model")
    assert f.message == "model_hash mismatch: the cache /c was not computed with this model"
    assert f.error().__class__.__name__ == "StampMismatch"
    (f,) = rules.stamp_findings(recorded, {"tokenizer_hash": "y"}, where="the cache /c",
                                tokenizer_parts={"vocab": "a", "chat_template": "other"})
    assert f.message == "tokenizer_hash mismatch: the cache /c was not computed with this tokenizer; it differs in: " \
        "chat_template"
    assert f.remedy == fmt.RERUN  # no remedy given: the rule book's own
    assert rules.stamp_findings(recorded, {"model_hash": MODEL, "tokenizer_hash": TOKENIZER}) == []
    (f,) = rules.stamp_findings({}, {"model_hash": MODEL})  # a record without stamps matches nothing
    assert f.found is None


def test_option_findings_name_the_option_the_callers_way():
    (f,) = rules.option_findings(ENC, {"max_length": 32, "truncation_mode": None}, where="the cache /c",
                                 option=lambda k: "--" + k.replace("_", "-"), remedy="drop it")
    assert f.message == "--max-length 32 conflicts with the cache /c, made with --max-length 64"
    assert (f.kind, f.expected, f.found, f.remedy) == ("encoding", 32, 64, "drop it")


def test_row_findings_name_the_shard_and_row(pristine):
    index = pa.table({"id": ["a", "b", "c"], "mask_checksum": ["1", "2", "3"], "shard": ["s0", "s0", "s1"],
                      "row": pa.array([0, 1, 0], pa.uint32())})
    assert rules.row_findings(index, {"c": "3", "a": "1"}) == []
    (f,) = rules.row_findings(index, {"a": "1", "c": "9"})
    assert (f.kind, f.shard, f.row, f.expected, f.found) == ("mask_checksum", "s1", 0, "9", "3")
    (f,) = rules.row_findings(index, {"a": "1", "x": "1", "y": "2"}, where="the cache /c",
                              remedies={"rows_missing": "precompute them"})
    assert (f.kind, f.count, f.remedy) == ("rows_missing", 2, "precompute them")
    assert f.message == "2 of 3 data rows are not in the cache /c; first ids: 'x', 'y'"
