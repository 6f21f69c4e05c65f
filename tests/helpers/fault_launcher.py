"""precompute-ref or train-dpo with one fault injected at a chosen point, for the crash and concurrency tests.

Usage: python tests/helpers/fault_launcher.py {precompute-ref|train-dpo} COMMAND-ARGS...
       python tests/helpers/fault_launcher.py --zygote RUNS.json

The zygote imports the commands once and forks one child process per run in RUNS.json (a list of {"name", "command",
"args", "env", "stdout", "stderr", "status"}): each child is a real process running the real command with its own
fault, and its exit status (negative: killed by that signal, as subprocess reports it) is written to "status" when it
ends. It saves the few seconds of imports per process that a fresh interpreter would spend.

Environment (everything else about the run is the real command):
  FAULT_AT      where to stop:
                  first_shard     precompute-ref: the first shard is scored, nothing written yet
                  shard_write     inside the write of shard FAULT_SHARD: half its bytes in the temp file, not renamed
                                  (on an object store: not uploaded)
                  shard_renamed   shard FAULT_SHARD's temp file renamed into place, before the directory fsync and
                                  anything after it (the manifest); on an object store: the shard uploaded
                  manifest_write  inside the manifest write: half its bytes in the temp file, not renamed
                  checkpoint      train-dpo: checkpoint-FAULT_STEP completely saved, before the next step
                  checkpoint_write  train-dpo: inside the save of checkpoint-FAULT_STEP: weights and optimizer
                                  written, RNG states and trainer_state.json not yet
  FAULT_SHARD   index of the shard in the plan (shard-NNNNN.parquet), or "last"
  FAULT_STEP    global step of the checkpoint (train-dpo)
  FAULT_ACTION  kill (SIGKILL itself; the default) or pause (wait until FAULT_GO exists, then carry on)
  FAULT_MARKER  file created when the fault point is reached (before the kill or the pause)
  FAULT_GO      pause: file whose appearance lets the run continue
  FAULT_AFTER   (zygote runs) start the command only once this file exists
"""

import io
import os
import signal
import sys
import time
from pathlib import Path

_plan = []


def fault():
    marker = os.environ.get("FAULT_MARKER")
    if marker:
        Path(marker).write_text(str(os.getpid()))
    if os.environ.get("FAULT_ACTION", "kill") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 300
    while not Path(os.environ["FAULT_GO"]).exists():
        if time.monotonic() > deadline:
            sys.exit("fault_launcher: FAULT_GO never appeared")
        time.sleep(0.05)


def target_shard() -> str:
    which = os.environ.get("FAULT_SHARD", "0")
    return _plan[-1]["file"] if which == "last" else f"shard-{int(which):05d}.parquet"


def patch_precompute():
    from precompute import prepare

    AT = os.environ.get("FAULT_AT", "")
    from schemas import format as fmt

    plan_shards = prepare.plan_shards

    def recording_plan(*args, **kwargs):
        _plan[:] = plan_shards(*args, **kwargs)
        return _plan

    prepare.plan_shards = recording_plan

    if AT == "first_shard":
        write_shard = fmt.write_shard

        def die_before_writing(*args, **kwargs):
            fault()
            return write_shard(*args, **kwargs)

        fmt.write_shard = die_before_writing  # precompute.job calls it as fmt.write_shard

    if AT in ("shard_write", "manifest_write"):
        atomic_write = fmt.atomic_write

        def half_then_fault(path, write):
            wanted = fmt.MANIFEST if AT == "manifest_write" else target_shard()
            if Path(path).name != wanted:
                return atomic_write(path, write)

            def write_in_two(f):
                buf = io.BytesIO()
                write(buf)
                data = buf.getvalue()
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                fault()
                f.write(data[len(data) // 2 :])

            return atomic_write(path, write_in_two)

        fmt.atomic_write = half_then_fault  # write_shard and write_manifest look it up in the module

        from storage import writes  # on an object store: half the bytes in the local temporary file, nothing uploaded

        write_whole = writes.write_whole

        def remote_half_then_fault(path, write, **kwargs):
            wanted = fmt.MANIFEST if AT == "manifest_write" else target_shard()
            if path.name != wanted:
                return write_whole(path, write, **kwargs)

            def write_in_two(f):
                buf = io.BytesIO()
                write(buf)
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                fault()

            return write_whole(path, write_in_two, **kwargs)

        writes.write_whole = remote_half_then_fault  # format.write_whole looks it up in the module

    if AT == "shard_renamed":
        replace = os.replace

        def replace_then_fault(src, dst, *args, **kwargs):
            replace(src, dst, *args, **kwargs)
            if Path(dst).name == target_shard():
                fault()

        os.replace = replace_then_fault  # schemas.format calls os.replace

        from storage import writes  # on an object store: the shard uploaded, nothing after it

        write_whole = writes.write_whole

        def upload_then_fault(path, write, **kwargs):
            written = write_whole(path, write, **kwargs)
            if path.name == target_shard():
                fault()
            return written

        writes.write_whole = upload_then_fault


def patch_train():
    import transformers

    AT = os.environ.get("FAULT_AT", "")
    save = transformers.Trainer._save_checkpoint
    step = int(os.environ.get("FAULT_STEP", 0))

    def save_then_fault(self, *args, **kwargs):
        save(self, *args, **kwargs)
        if AT == "checkpoint" and self.state.global_step == step:
            fault()

    transformers.Trainer._save_checkpoint = save_then_fault

    save_rng = transformers.Trainer._save_rng_state

    def fault_before_rng_state(self, *args, **kwargs):
        if AT == "checkpoint_write" and self.state.global_step == step:
            fault()
        return save_rng(self, *args, **kwargs)

    transformers.Trainer._save_rng_state = fault_before_rng_state


def run(command, args):
    if command == "precompute-ref":
        patch_precompute()
        from precompute.cli import main as cli
    elif command == "train-dpo":
        patch_train()
        from dpo.cli import main as cli
    elif command == "audit-ref":
        from audit.cli import main as cli
    else:
        sys.exit(f"fault_launcher: unknown command {command!r}")
    cli(args=args, prog_name=command)


def zygote(spec_path):
    import json

    # Everything heavy, imported once before forking (no torch op has run yet): imported for the import's sake.
    import datasets  # noqa: F401  (preloaded)
    import transformers  # noqa: F401  (preloaded)
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer  # noqa: F401  (preloaded)

    import dpo.cli
    import dpo.recipe
    import dpo.trainer  # noqa: F401  (preloaded)
    import audit.cli  # noqa: F401  (preloaded)
    import precompute.cli
    import precompute.job  # noqa: F401  (preloaded)

    runs = json.loads(Path(spec_path).read_text())
    children = {}
    for r in runs:
        pid = os.fork()
        if pid == 0:  # the child: its own output files, its own fault, the real command
            code = 1
            try:
                os.environ.update(r.get("env", {}))
                after = os.environ.get("FAULT_AFTER")  # start only once this file exists
                while after and not Path(after).exists():
                    time.sleep(0.05)
                for fd, name in ((1, "stdout"), (2, "stderr")):
                    out = os.open(r[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(out, fd)
                    os.close(out)
                run(r["command"], r["args"])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = r
    while children:
        pid, status = os.wait()
        r = children.pop(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        tmp = Path(r["status"] + ".tmp")
        tmp.write_text(str(code))
        tmp.rename(r["status"])


def main():
    if sys.argv[1] == "--zygote":
        zygote(sys.argv[2])
    else:
        run(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
