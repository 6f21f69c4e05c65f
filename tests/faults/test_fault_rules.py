"""Issue 14: one rule set for a cache. The eight hostile cases (a rerun over a damaged shard, another dtype, the
recorded mode, renamed rows, the model hash's files, --overwrite next to input data, an output dir over the model,
a resume against another reference), and each rule of schemas/rules.py raised by open_cache and reported by
audit-ref under its own name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import pref_rows, write_jsonl
from faultkit import (TRAIN, audit, copy_tree, edit_manifest, failed_checks, file_hashes, manifest_of, precompute,
                      restamp, rewrite_rows, set_metadata, train)
from schemas import format as fmt
from schemas.cache import open_cache
from schemas.stamps import model_hash, weight_files

ROWS, PER_SHARD = 12, 4
S0, S1 = "shard-00000.parquet", "shard-00001.parquet"


def scored_now(output: str) -> int:
    m = re.search(r"\((\d+) scored now\)", output)
    assert m, output
    return int(m.group(1))


@pytest.fixture(scope="module")
def world(tmp_path_factory, llama_dir):
    base = tmp_path_factory.mktemp("rules")
    data = write_jsonl(base / "data" / "prefs.jsonl", pref_rows(ROWS, seed=5))
    args = ["--model", llama_dir, "--data", data, "--rows-per-shard", PER_SHARD]
    clean = precompute(*args, "--out", base / "clean")
    assert clean.exit_code == 0, clean.output
    return {"base": base, "data": data, "args": args, "clean": base / "clean", "model": llama_dir}


def same_as_clean(out: Path, clean: Path):
    """Shards and manifest equal to a clean run's (minus timestamps), computation included."""
    assert file_hashes(out, "*.parquet") == file_hashes(clean, "*.parquet")
    ours, theirs = manifest_of(out), manifest_of(clean)
    for m in (ours, theirs):
        m.pop("created_at")
        m["source"].pop("data")
        m["model"].pop("path")
    assert ours == theirs
    open_cache(out)


# ---------------------------------------------------------------------------------------------------------------
# 1-4: precompute-ref reruns


def test_1_rerun_rescores_a_damaged_shard(world, tmp_path):
    out = copy_tree(world["clean"], tmp_path / "cache")
    data = bytearray((out / S1).read_bytes())
    data[len(data) // 3] ^= 0x04
    (out / S1).write_bytes(bytes(data))
    rerun = precompute(*world["args"], "--out", out)
    assert rerun.exit_code == 0, rerun.output
    assert scored_now(rerun.output) == PER_SHARD and f"{S1} is damaged" in rerun.output
    same_as_clean(out, world["clean"])


def test_1_rerun_without_a_manifest_rescores_a_shard_whose_footer_is_damaged(world, tmp_path):
    out = copy_tree(world["clean"], tmp_path / "cache")
    (out / fmt.MANIFEST).unlink()
    data = (out / S0).read_bytes()
    (out / S0).write_bytes(data[:-8] + b"\0" * 4 + data[-4:])  # the footer length: unreadable footer
    rerun = precompute(*world["args"], "--out", out)
    assert rerun.exit_code == 0, rerun.output
    assert scored_now(rerun.output) == PER_SHARD
    same_as_clean(out, world["clean"])


@pytest.mark.parametrize("manifest", [True, False], ids=["complete", "interrupted"])
def test_2_rerun_with_another_dtype_is_refused_or_starts_over_with_overwrite(world, tmp_path, manifest):
    out = copy_tree(world["clean"], tmp_path / "cache")
    if not manifest:
        (out / fmt.MANIFEST).unlink()
        (out / "shard-00002.parquet").unlink()
    before = file_hashes(out)
    refused = precompute(*world["args"], "--out", out, "--dtype", "bfloat16")
    assert refused.exit_code == 2, refused.output
    assert "the cache: --dtype float32" in refused.output and "this run:  --dtype bfloat16" in refused.output
    assert "--overwrite" in refused.output
    assert file_hashes(out) == before
    again = precompute(*world["args"], "--out", out, "--dtype", "bfloat16", "--overwrite")
    assert again.exit_code == 0, again.output
    assert scored_now(again.output) == ROWS
    assert manifest_of(out)["computation"]["dtype"] == "bfloat16"
    open_cache(out)


@pytest.mark.parametrize("option", [["--attn-implementation", "eager"], ["--batching", "full_forward"],
                                    ["--token-budget", "999"]])
def test_2_rerun_with_other_settings_is_refused(world, tmp_path, option):
    out = copy_tree(world["clean"], tmp_path / "cache")
    before = file_hashes(out)
    refused = precompute(*world["args"], "--out", out, *option)
    assert refused.exit_code == 2, refused.output
    assert "--overwrite" in refused.output and file_hashes(out) == before


def test_2_a_shard_scored_with_other_settings_than_the_others_is_refused(world, tmp_path):
    out = copy_tree(world["clean"], tmp_path / "cache")
    (out / fmt.MANIFEST).unlink()
    comp = manifest_of(world["clean"])["computation"]
    comp = comp | {"mode": "full_forward" if comp["mode"] != "full_forward" else "packed"}
    set_metadata(out, S1, "computation", json.dumps(comp, sort_keys=True, separators=(",", ":")))
    refused = precompute(*world["args"], "--out", out)
    assert refused.exit_code == 2, refused.output
    assert "other settings than the rest" in refused.output and "mode" in refused.output


@pytest.mark.parametrize("lost", ["nothing", "manifest"])
def test_3_recorded_mode_is_the_mode_that_scored_never_auto(world, tmp_path, lost):
    """A rerun over a complete cache, and a kill between the last shard and the manifest, record what scored."""
    out = copy_tree(world["clean"], tmp_path / "cache")
    if lost == "manifest":
        (out / fmt.MANIFEST).unlink()
    rerun = precompute(*world["args"], "--out", out)
    assert rerun.exit_code == 0, rerun.output
    assert scored_now(rerun.output) == 0
    comp = manifest_of(out)["computation"]
    assert comp["mode"] != "auto" and comp["requested_batching"] == "auto"
    same_as_clean(out, world["clean"])


def test_4_renamed_rows_are_refused(world, tmp_path):
    out = copy_tree(world["clean"], tmp_path / "cache")
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{**r, "id": "x" + r["id"]} for r in pref_rows(ROWS, seed=5)])
    before = file_hashes(out)
    refused = precompute("--model", world["model"], "--data", renamed, "--rows-per-shard", PER_SHARD, "--out", out)
    assert refused.exit_code == 2, refused.output
    assert "ids_checksum" in refused.output and "--overwrite" in refused.output
    assert file_hashes(out) == before


# ---------------------------------------------------------------------------------------------------------------
# 5: the model hash covers exactly the files transformers loads


def test_5_model_hash_follows_the_file_transformers_loads(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    both = copy_tree(llama_dir, tmp_path / "both")
    tensors = load_file(both / "model.safetensors")
    decoy = {k: torch.zeros_like(v) for k, v in tensors.items()}
    save_file(decoy, both / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in decoy}}
    (both / "model.safetensors.index.json").write_text(json.dumps(index))

    assert weight_files(both) == [both.resolve() / "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(both, use_safetensors=True).state_dict()
    name = next(k for k in tensors if k in loaded)
    assert torch.equal(loaded[name], tensors[name])  # transformers loads model.safetensors, not the index
    assert model_hash(both) == model_hash(llama_dir)

    changed = {k: v.clone() for k, v in tensors.items()}
    changed[name].view(-1)[0] += 1
    save_file(changed, both / "model.safetensors", metadata={"format": "pt"})
    assert model_hash(both) != model_hash(llama_dir)  # the loaded file changed: so did the hash


def test_5_stray_safetensors_without_the_loaded_name_are_refused(llama_dir, tmp_path):
    from schemas.stamps import WeightsError

    odd = copy_tree(llama_dir, tmp_path / "odd")
    (odd / "model.safetensors").rename(odd / "weights.safetensors")
    with pytest.raises(WeightsError, match="no model.safetensors or model.safetensors.index.json"):
        weight_files(odd)


# ---------------------------------------------------------------------------------------------------------------
# 6: --overwrite deletes only the cache's own files


def test_6_overwrite_next_to_the_data_deletes_nothing(world, tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(pref_rows(ROWS, seed=5)), folder / "train.parquet")
    before = file_hashes(folder)
    refused = precompute("--model", world["model"], "--data", folder / "train.parquet", "--out", folder, "--overwrite")
    assert refused.exit_code == 2, refused.output
    assert "contains --data" in refused.output
    assert file_hashes(folder) == before


def test_6_overwrite_refuses_a_folder_holding_other_files(world, tmp_path):
    out = copy_tree(world["clean"], tmp_path / "cache")
    (out / "notes.txt").write_text("mine")
    (out / "other.parquet").write_bytes(b"PAR1 not ours PAR1")
    before = file_hashes(out)
    refused = precompute(*world["args"], "--out", out, "--overwrite")
    assert refused.exit_code == 2, refused.output
    assert "not this cache's own" in refused.output and "notes.txt" in refused.output
    assert file_hashes(out) == before


def test_6_overwrite_replaces_the_cache_and_an_interrupted_runs_shards(world, tmp_path):
    out = copy_tree(world["clean"], tmp_path / "cache")
    edit_manifest(out, lambda m: m["shards"].pop())  # shard-00002 now unlisted, but a refcache shard by its footer
    again = precompute(*world["args"], "--out", out, "--overwrite")
    assert again.exit_code == 0, again.output
    assert scored_now(again.output) == ROWS
    same_as_clean(out, world["clean"])


# ---------------------------------------------------------------------------------------------------------------
# 7-8: train-dpo's output dir and resume


@pytest.mark.parametrize("where", ["model", "inside_model", "cache", "around_data", "inside_cache"])
def test_7_output_dir_apart_from_every_input(llama_dir, dpo_data, dpo_cache, tmp_path, where):
    model = copy_tree(llama_dir, tmp_path / "model")
    out = {"model": model, "inside_model": model / "out", "cache": dpo_cache, "around_data": dpo_data.parent,
           "inside_cache": dpo_cache / "run"}[where]
    before = file_hashes(model), file_hashes(dpo_cache), file_hashes(dpo_data.parent)
    refused = train("--model", model, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN)
    assert refused.exit_code == 2, refused.output
    assert "--output-dir" in refused.output and "could overwrite or delete an input" in refused.output
    assert (file_hashes(model), file_hashes(dpo_cache), file_hashes(dpo_data.parent)) == before
    assert not (dpo_cache / "run").exists() and not (model / "out").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, llama_dir, dpo_data, dpo_cache):
    """A 2-step run saving checkpoint-1 and checkpoint-2, and a second cache of the same data (other shards)."""
    base = tmp_path_factory.mktemp("trained")
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, *TRAIN[:TRAIN.index("--max-steps")],
            *TRAIN[TRAIN.index("--max-steps") + 2:], "--max-steps", "2", "--save-steps", "1", "--seed", "7"]
    run = train(*args, "--output-dir", base / "run")
    assert run.exit_code == 0, run.output
    other = precompute("--model", llama_dir, "--data", dpo_data, "--rows-per-shard", 7, "--out", base / "other-cache")
    assert other.exit_code == 0, other.output
    return {"base": base, "args": args, "run": base / "run", "other_cache": base / "other-cache"}


def test_7_a_used_output_dir_needs_overwrite_output_dir(trained):
    before = file_hashes(trained["run"])
    refused = train(*trained["args"], "--output-dir", trained["run"])
    assert refused.exit_code == 2, refused.output
    assert "--overwrite-output-dir" in refused.output and file_hashes(trained["run"]) == before


def test_8_resume_against_another_cache_is_refused(trained, tmp_path):
    run = copy_tree(trained["run"], tmp_path / "run")  # a resume continues in the run's own output dir
    ckpt = run / "checkpoint-1"
    record = json.loads((ckpt / "refcache-reference.json").read_text())
    assert record["cache"]["manifest_sha256"] and record["data_fingerprint"]
    args = list(trained["args"])
    i = args.index("--ref-cache")
    other = [*args[:i + 1], trained["other_cache"], *args[i + 2:]]
    refused = train(*other, "--output-dir", run, "--resume-from-checkpoint", ckpt)
    assert refused.exit_code == 2, refused.output
    assert "trained with another reference cache (--ref-cache)" in refused.output
    # the two caches by their ids and paths, one line each (not two dict reprs)
    theirs = json.loads((trained["run"] / "run-manifest.json").read_text())["reference"]["cache"]["cache_id"]
    lines = refused.output.splitlines()
    gave = next(line for line in lines if line.strip().startswith("you gave:"))
    assert next(line for line in lines if line.strip().startswith("trained with:")).split()[2] == theirs
    assert str(trained["other_cache"]) in gave and theirs not in gave and "{" not in refused.output
    (ckpt / "refcache-reference.json").unlink()
    refused = train(*args, "--output-dir", run, "--resume-from-checkpoint", ckpt)
    assert refused.exit_code == 2 and "does not say which reference" in refused.output, refused.output


def test_8_resume_into_the_same_dir_does_not_duplicate_metrics(trained, tmp_path):
    run = copy_tree(trained["run"], tmp_path / "run")
    before = (run / "metrics.jsonl").read_text().splitlines()
    resumed = train(*trained["args"], "--output-dir", run, "--resume-from-checkpoint", run / "checkpoint-1")
    assert resumed.exit_code == 0, resumed.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["step"], "eval" if any(k.startswith("eval_") for k in r) else "train") for r in records]
    assert len(keys) == len(set(keys)) and len(records) == len(before)
    run_manifest = json.loads((run / "run-manifest.json").read_text())
    assert run_manifest["reference"]["cache"]["manifest_sha256"] == json.loads(
        (trained["run"] / "checkpoint-1" / "refcache-reference.json").read_text())["cache"]["manifest_sha256"]


# ---------------------------------------------------------------------------------------------------------------
# each rule: open_cache raises it, audit-ref reports it under its own check


def rename_row(root):
    rewrite_rows(root, S0, lambda rows: rows[1].update(id="renamed"))
    restamp(root, S0)


def footer_computation(root):
    comp = manifest_of(root)["computation"] | {"dtype": "bfloat16"}
    set_metadata(root, S1, "computation", json.dumps(comp, sort_keys=True, separators=(",", ":")))
    restamp(root, S1)


def manifest_computation(root):
    edit_manifest(root, lambda m: m["computation"].__setitem__("mode", "auto"))


def manifest_rows(root):
    edit_manifest(root, lambda m: m.__setitem__("rows", m["rows"] + 1))


def shard_listed_twice(root):
    edit_manifest(root, lambda m: m["shards"].append(dict(m["shards"][0])))


def value_nudged(root):
    def edit(rows):
        rows[2]["chosen_logps"][0] -= 1e-3
    rewrite_rows(root, S0, edit)
    restamp(root, S0)


RULES = [  # (damage, open_cache kind, audit check that fails)
    (rename_row, "ids_checksum", "shard_checksums"),
    (footer_computation, "computation", "shard_stamps"),
    (manifest_computation, "computation", "shard_stamps"),
    (manifest_rows, "manifest", "manifest"),
    (shard_listed_twice, "manifest", "manifest"),
]


@pytest.mark.parametrize("damage,kind,check", RULES, ids=[r[0].__name__ for r in RULES])
def test_each_rule_refused_by_open_cache_and_reported_by_audit(world, tmp_path, damage, kind, check):
    root = copy_tree(world["clean"], tmp_path / "cache")
    damage(root)
    with pytest.raises(fmt.CacheError) as err:
        open_cache(root)
    assert err.value.kind == kind and err.value.remedy
    code, report, output = audit(root)
    assert code == 1, output
    assert check in failed_checks(report)


def test_a_value_nudged_past_the_sum_tolerance_is_refused_by_train_dpo_and_audit(world, tmp_path):
    from dpo.verify import check_values

    root = copy_tree(world["clean"], tmp_path / "cache")
    value_nudged(root)
    cache = open_cache(root)  # the file hashes were restamped: only the value rules can see it
    with pytest.raises(fmt.CacheError) as err:
        check_values(cache, [f"r{i:04d}" for i in range(ROWS)])
    assert err.value.kind == "values" and (err.value.shard, err.value.row) == (S0, 2)
    code, report, _ = audit(root)
    assert failed_checks(report) == {"sums"}


# ---------------------------------------------------------------------------------------------------------------
# one implementation of the sums rule and of the footer check, found by what the code does (an AST scan of the
# product's rooms), so that a twin spelled differently is found too (see also tests/test_one_implementation.py)


def _product_modules():
    import ast

    repo = Path(__file__).resolve().parents[2]
    for room in ("storage", "schemas", "runtime", "precompute", "dpo", "audit"):
        for path in sorted((repo / room).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            yield path.relative_to(repo).as_posix(), tree, parents


def _function_of(node, parents) -> str:
    import ast

    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.name
    return "<module>"


def _names_bound_to(func, is_source) -> set[str]:
    """Names a function binds (plainly or by tuple unpacking) to an expression for which is_source holds, or to one
    built from such a name."""
    import ast

    bound: set[str] = set()
    derived = lambda v: is_source(v) or any(isinstance(n, ast.Name) and n.id in bound for n in ast.walk(v))
    for _ in range(3):  # to a fixpoint: names bound to what a bound name holds (footer = read(); meta = footer.meta)
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                             and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                    bound |= {t.id for t, v in pairs if isinstance(t, ast.Name) and derived(v)}
    return bound


def _uses(node, names: set[str]) -> bool:
    import ast

    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def test_one_float64_sum_and_one_sum_tolerance():
    """The stored sums are the float64 sum of the float32 values: computed once by the writer (format.shard_table)
    and once by the check (rules._sum64), and compared with a tolerance in one place, with one constant."""
    import ast

    def float64_sum(node) -> bool:  # a .sum() over something cast to float64, however it is spelled
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sum"
                and any(isinstance(n, ast.Attribute) and n.attr in ("Float64", "float64") for n in ast.walk(node)))

    modules = list(_product_modules())
    sums = {(name, _function_of(n, parents)) for name, tree, parents in modules for n in ast.walk(tree)
            if float64_sum(n)}
    assert sums == {("schemas/format.py", "shard_table"), ("schemas/rule_rows.py", "_sum64")}
    summing = {f for _, f in sums}

    def is_sum(node) -> bool:
        return float64_sum(node) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                                     and node.func.id in summing)

    def absolute(node) -> bool:
        return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "abs"
                   for n in ast.walk(node))

    compared = []  # |a float64 sum - something| against a tolerance
    for name, tree, _ in modules:
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            sum_names = _names_bound_to(func, is_sum)
            for cmp in (n for n in ast.walk(func) if isinstance(n, ast.Compare)):
                sides = [cmp.left, *cmp.comparators]
                if any(absolute(s) and (_uses(s, sum_names) or any(is_sum(n) for n in ast.walk(s))) for s in sides):
                    compared.append((name, func.name, [ast.unparse(s) for s in sides if not absolute(s)]))
    assert compared == [("schemas/rule_rows.py", "_close", ["SUM_TOLERANCE"])]
    tolerances = [(name, t.id) for name, tree, _ in modules for node in tree.body if isinstance(node, ast.Assign)
                  for t in node.targets if isinstance(t, ast.Name) and t.id == "SUM_TOLERANCE"]
    assert tolerances == [("schemas/rule_rows.py", "SUM_TOLERANCE")]


def test_one_footer_read_and_one_footer_comparison():
    """A shard's footer is compared with what the manifest says in one function (rules.shard_footer_findings);
    resume only asks whether a footer is refcache's. (That it is read by one function, format.read_footer, is
    tests/test_one_implementation.py::test_one_footer_reader.)"""
    import ast

    def reads_footer(node) -> bool:
        return (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                in ("read_shard_metadata", "read_footer"))

    modules = list(_product_modules())
    comparing = []
    for name, tree, _ in modules:
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            footers = _names_bound_to(func, reads_footer)
            for cmp in (n for n in ast.walk(func) if isinstance(n, ast.Compare)
                        and any(isinstance(o, (ast.Eq, ast.NotEq)) for o in n.ops)):
                if _uses(cmp, footers) or any(reads_footer(n) for n in ast.walk(cmp)):
                    comparing.append((name, func.name))
    assert sorted(set(comparing)) == [("schemas/rule_files.py", "shard_footer_findings")]
