"""A run into an --out that already holds scored rows takes the settings they were scored with (issue 36, theme 1):
a resume of an interrupted first run re-run without its options, and --update alike; an option given that differs is
refused in the options a user types, the two sides labelled by owner, and the remedy never loops (an interrupted first
run is never told to --update). Each case is the command as typed and the message asserted."""

from __future__ import annotations

from support import dir_state, manifest_of, pref_rows, precompute_cli, scored_now, write_jsonl

from schemas import format as fmt

SETTINGS = ("--rows-per-shard", 6, "--top-k", 4, "--max-length", 48)


def _interrupted(llama_dir, data, out):
    """A first run with settings, its manifest gone: what Ctrl-C or kill -9 after some shards leaves."""
    done = precompute_cli("--model", llama_dir, "--data", data, "--out", out, *SETTINGS)
    assert done.exit_code == 0, done.output
    (out / fmt.MANIFEST).unlink()
    (out / fmt.CARD).unlink(missing_ok=True)
    for late in sorted(out.glob("shard-*.parquet"))[2:]:
        late.unlink()
    return dir_state(out)


def test_an_interrupted_first_run_resumed_without_its_options_takes_them_from_its_shards(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(20))
    out = tmp_path / "cache"
    _interrupted(llama_dir, data, out)
    resumed = precompute_cli("--model", llama_dir, "--data", data, "--out", out)
    assert resumed.exit_code == 0, resumed.output
    assert "resume: the interrupted run's settings: --rows-per-shard 6, --top-k 4" in resumed.output
    assert "--max-length 48" in resumed.output
    assert scored_now(resumed) == (20, 8)  # 2 shards of 6 kept
    computation = manifest_of(out)["computation"]
    assert computation["top_k"] == 4 and computation["rows_per_shard"] == 6
    assert manifest_of(out)["encoding"]["max_length"] == 48


def test_an_option_that_differs_from_the_interrupted_runs_is_refused_naming_the_option(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(20))
    out = tmp_path / "cache"
    before = _interrupted(llama_dir, data, out)
    for given, cache, run in ((("--top-k", 8), "--top-k 4", "--top-k 8"),
                              (("--rows-per-shard", 5), "--rows-per-shard 6", "--rows-per-shard 5"),
                              (("--max-length", 64), "--max-length 48", "--max-length 64"),
                              # an option at its old default is left out of the footer: still compared as an option
                              (("--completion-end", "template"), "--completion-end eos",
                               "--completion-end template")):
        refused = precompute_cli("--model", llama_dir, "--data", data, "--out", out, *given)
        assert refused.exit_code == 2, refused.output
        assert f"the cache: {cache}" in refused.output and f"this run:  {run}" in refused.output, refused.output
        assert f"pass {cache} (the cache's own)" in refused.output and "--overwrite" in refused.output
        assert "{" not in refused.output  # no raw dicts
        assert dir_state(out) == before


def test_an_interrupted_first_run_of_other_data_is_never_told_to_update(llama_dir, tmp_path):
    rows = pref_rows(20)
    out = tmp_path / "cache"
    before = _interrupted(llama_dir, write_jsonl(tmp_path / "d.jsonl", rows), out)
    other = write_jsonl(tmp_path / "other.jsonl", pref_rows(20, seed=7))
    fewer = write_jsonl(tmp_path / "fewer.jsonl", rows[:9])  # the second shard would hold other rows
    for data in (other, fewer):
        refused = precompute_cli("--model", llama_dir, "--data", data, "--out", out)
        assert refused.exit_code == 2, refused.output
        assert "interrupted first run (no manifest.json yet)" in refused.output and "--update" not in refused.output
        assert "--overwrite" in refused.output
        assert dir_state(out) == before  # nothing scored again over the interrupted run's shards


def test_update_refuses_a_differing_setting_with_owner_labels(llama_dir, tmp_path):
    rows = pref_rows(20)
    out = tmp_path / "cache"
    made = precompute_cli("--model", llama_dir, "--data", write_jsonl(tmp_path / "v1.jsonl", rows[:14]), "--out", out,
                          *SETTINGS)
    assert made.exit_code == 0, made.output
    before = dir_state(out)
    grown = write_jsonl(tmp_path / "v2.jsonl", rows)
    for given, cache, run in ((("--top-k", 2), "--top-k 4", "--top-k 2"),
                              (("--max-length", 64), "--max-length 48", "--max-length 64")):
        refused = precompute_cli("--model", llama_dir, "--data", grown, "--out", out, "--update", *given)
        assert refused.exit_code == 2, refused.output
        assert f"the cache {out} was made with {cache}; this run gives {run}" in refused.output, refused.output
        assert f"the cache: {cache}" in refused.output and f"this run:  {run}" in refused.output
        assert "{" not in refused.output and "top_k=" not in refused.output
        assert dir_state(out) == before
    updated = precompute_cli("--model", llama_dir, "--data", grown, "--out", out, "--update")
    assert updated.exit_code == 0, updated.output
    assert "6 rows added" in updated.output, updated.output


def test_update_given_by_name_what_the_caches_auto_chose_takes_the_caches_auto(llama_dir, tmp_path):
    """UX pass: `--update --attn-implementation sdpa --batching packed` on a cache whose auto chose sdpa and packed
    was refused as a differing setting; it is the same scoring, so the cache's request (auto) is kept. Another
    named choice is still refused."""
    rows = pref_rows(12)
    out = tmp_path / "cache"
    made = precompute_cli("--model", llama_dir, "--data", write_jsonl(tmp_path / "v1.jsonl", rows[:8]), "--out", out)
    assert made.exit_code == 0, made.output
    chose = manifest_of(out)["computation"]
    attention, mode = chose["attn_implementation"], chose["mode"]
    grown = write_jsonl(tmp_path / "v2.jsonl", rows)
    other = next(m for m in ("single", "full_forward") if m != mode)
    refused = precompute_cli("--model", llama_dir, "--data", grown, "--out", out, "--update", "--batching", other)
    assert refused.exit_code == 2 and f"this run gives --batching {other}" in refused.output, refused.output
    updated = precompute_cli("--model", llama_dir, "--data", grown, "--out", out, "--update",
                             "--attn-implementation", attention, "--batching", mode)
    assert updated.exit_code == 0, updated.output
    assert f"--batching auto (the cache's; it chose {mode}, as given)" in updated.output
    assert f"--attn-implementation auto (the cache's; it chose {attention}, as given)" in updated.output
    recorded = manifest_of(out)["computation"]
    assert recorded["requested_batching"] == "auto" and recorded["requested_attn_implementation"] == "auto"
    assert "4 rows added" in updated.output


def test_an_encoding_option_that_rows_cannot_take_is_refused_as_the_setting_it_is(llama_dir, tmp_path):
    """Found by the UX pass: `--update --chat-template off` on a cache of conversational rows answered with a bad row
    (the rows were encoded before the settings were compared); it is the setting that differs, said so before any row
    is read, and the same for a rerun into the cache without --update."""
    rows = pref_rows(10, fmt="conversational")
    out = tmp_path / "cache"
    made = precompute_cli("--model", llama_dir, "--data", write_jsonl(tmp_path / "v1.jsonl", rows[:6]), "--out", out)
    assert made.exit_code == 0, made.output
    before = dir_state(out)
    grown = write_jsonl(tmp_path / "v2.jsonl", rows)
    for update in (("--update",), ()):
        refused = precompute_cli("--model", llama_dir, "--data", grown, "--out", out, *update, "--chat-template", "off")
        assert refused.exit_code == 2, refused.output
        assert "made with --chat-template auto; this run gives --chat-template off" in refused.output, refused.output
        assert "needs_chat_template" not in refused.output and dir_state(out) == before
