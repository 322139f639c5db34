"""A small mutation check: break the code on purpose, one known way at a time, and make sure a test
notices. Each mutation is applied to a copy of the repository, never to this one.

    python tools/mutations.py            # every mutation the CPU suite must kill (exit 1 if one survives)
    python tools/mutations.py --list     # the mutations, including those only the GPU tier can kill

A mutation whose text no longer occurs in its file fails the check too: the list must follow the code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("helpers", "tests", "data", "tools", "pyproject.toml", "requirements.txt", "README.md")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple
    gpu_only: bool = False  # killed by the GPU tier (make test-gpu-tier), not by the CPU suite


MUTATIONS = (
    Mutation("the CPU lookup gathers the wrong rows", "helpers/placement.py",
             "rows = torch.nn.functional.embedding(input_ids.to(self.weight.device), self.weight, self.padding_idx)",
             "rows = torch.nn.functional.embedding((input_ids.to(self.weight.device) + 1) % self.weight.shape[0], "
             "self.weight, self.padding_idx)", ("tests/test_placement.py",)),
    Mutation("the CPU lookup forgets the embedding scale", "helpers/placement.py",
             "return rows if scale is None else rows * scale", "return rows", ("tests/test_placement.py",)),
    Mutation("the CPU lookup's CUDA branch returns zeros", "helpers/placement.py",
             "rows = rows.pin_memory().to(target, non_blocking=True)", "rows = torch.zeros_like(rows).to(target)",
             ("tests/gpu/test_ple_placement_gpu.py",), gpu_only=True),
    Mutation("installing the lookup leaves accelerate's offload hook on", "helpers/placement.py",
             "        remove_hook_from_module(module)", "        pass", ("tests/test_placement.py",)),
    Mutation("the validator accepts keys that name no module", "helpers/placement.py",
             "if key and key not in known:", "if False:", ("tests/test_placement.py",)),
    Mutation("fp4's bytes per weight 20% high", "helpers/weights.py",
             '"fp4": 0.5 + 4 / 64', '"fp4": (0.5 + 4 / 64) * 1.2', ("tests/test_quantization.py",)),
    Mutation("the GPU headroom is 720 MiB", "helpers/weights.py",
             "GPU_HEADROOM_BYTES = 600 * 1024**2", "GPU_HEADROOM_BYTES = 720 * 1024**2", ("tests/test_errors.py",)),
    Mutation("ple='cpu' forgets the offload flag bitsandbytes demands", "helpers/loading.py",
             'cpu_entries = target.type == "cuda" and "cpu" in set(device_map.values())', "cpu_entries = False",
             ("tests/gpu/test_ple_placement_gpu.py",), gpu_only=True),
    Mutation("the KV cache ignores the sliding window", "helpers/planner.py",
             'tokens = context if kind == "full_attention" else min(context, values["sliding_window"])',
             "tokens = context", ("tests/test_planner.py",)),
    Mutation("the planner forgets the table offload_ple copies into RAM", "helpers/planner.py",
             "copied = table if offload_after_load else 0", "copied = 0", ("tests/test_planner.py",)),
    Mutation("logits that differ a little count as identical", "helpers/measure.py",
             "if not torch.equal(reference[step], candidate[step])]",
             "if not torch.allclose(reference[step], candidate[step], atol=1.0)]", ("tests/test_loading.py",)),
    Mutation("the synthetic init repeats one token again (post-norms at 1)", "helpers/synthetic.py",
             "POST_NORM_SCALE = 8.0", "POST_NORM_SCALE = 1.0", ("tests/test_synthetic.py",)),
    Mutation("verification answers ok for any file that exists", "helpers/checksums.py",
             "result[name] = MISSING if not path.is_file() else OK if wanted.matches(path) else MISMATCH",
             "result[name] = MISSING if not path.is_file() else OK", ("tests/test_download.py",)),
)


def check_applies(mutation: Mutation) -> None:
    count = (ROOT / mutation.path).read_text().count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name!r}: its text occurs {count} times in {mutation.path}; update tools/mutations.py")


def killed(mutation: Mutation) -> bool:
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "repo"
        copy.mkdir()
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(source, copy / name)
        target = copy / mutation.path
        target.write_text(target.read_text().replace(mutation.old, mutation.new))
        env = {**os.environ, "PYTHONPATH": str(copy), "GEMMA_COURSE_CACHE": str(Path(scratch) / "cache")}
        done = subprocess.run([sys.executable, "-m", "pytest", *mutation.tests, "-x", "-q", "-p", "no:cacheprovider",
                               "-m", "not gpu"], cwd=copy, env=env, capture_output=True, text=True)
        return done.returncode != 0


def main(argv) -> int:
    for mutation in MUTATIONS:
        check_applies(mutation)
    if "--list" in argv:
        for mutation in MUTATIONS:
            print(f"{'GPU tier' if mutation.gpu_only else 'CPU suite'}: {mutation.name} ({mutation.path}; {', '.join(mutation.tests)})")
        return 0
    survivors = []
    for mutation in MUTATIONS:
        if mutation.gpu_only:
            print(f"  (GPU tier) {mutation.name}: killed only by {', '.join(mutation.tests)}")
            continue
        verdict = killed(mutation)
        print(f"  {'killed  ' if verdict else 'SURVIVED'} {mutation.name}", flush=True)
        if not verdict:
            survivors.append(mutation.name)
    print(f"{len(survivors)} survivor(s)" + (": " + "; ".join(survivors) if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
