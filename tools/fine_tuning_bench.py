"""QLoRA training steps on one simulated card, in this process: E4B-shaped NF4 with the PLE on the CPU, LoRA on
the text decoder, gradient checkpointing, paged 8-bit AdamW, the copy task. Sequence lengths are tried in
ascending order on one loaded model (the peak counter reset before each); the first out-of-memory error ends the
sweep, and is recorded as a result. Writes one JSON record.

    python tools/fine_tuning_bench.py --card-gb 8 --out build/fine-tuning-8.json
    python tools/fine_tuning_bench.py --card-gb 15 --sequences 512 1024 2048 4096 8192 --out ...
    python tools/fine_tuning_bench.py --card-gb 8 --loss-chunk none --out ...   # every logit at once, as transformers does
    python tools/fine_tuning_bench.py --sequences 512 2048 4096 8192 16384 --out ...   # no card: the whole GPU's profile

On a card, the planner's safe and largest sequences for it are tried beside the lengths asked for.

tests/gpu/test_fine_tuning_gpu.py runs it per card and, with GPU_RECORD=1, keeps the records in data/gpu-tier/.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers.fine_tuning import LOSS_CHUNK  # noqa: E402

SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
LOSS_STEPS = 20  # at the shortest sequence: enough for the copy task's loss to fall
TIMED_STEPS = 3  # at every other length: the peak and the speed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="e4b-shape")
    parser.add_argument("--card-gb", type=float, help="the card to simulate (default: none, the whole GPU: a profile)")
    parser.add_argument("--sequences", type=int, nargs="+", default=list(SEQUENCES))
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--loss-chunk", type=lambda text: None if text == "none" else int(text), default=LOSS_CHUNK,
                        help=f"positions whose logits the loss makes at a time, or none (default: {LOSS_CHUNK})")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    from helpers import cards, fine_tuning, loading, planner
    from lab.records import write_record

    cap = cards.simulate(args.card_gb)  # before anything touches the GPU
    model = fine_tuning.qlora(args.model, device=0)
    record = {"model": args.model, "card_gb": cap, "gpu": torch.cuda.get_device_name(0),
              "compute_dtype": str(loading.default_compute_dtype(torch.device("cuda", 0))),
              "resident_bytes": torch.cuda.memory_allocated(0), "optimizer": fine_tuning.optimizer_name("cuda"),
              "loss_chunk": args.loss_chunk, "torch": torch.__version__,
              "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "runs": []}
    sequences = set(args.sequences)
    if cap is not None:
        verdict = planner.training_fits(args.model, cap, loss_chunk=args.loss_chunk)
        record["planner"] = {"max_context": verdict.max_context, "safe_context": verdict.safe_context}
        sequences |= {n for n in (verdict.safe_context, verdict.max_context) if n}
    for index, sequence in enumerate(sorted(sequences)):
        predicted = planner.predict_training(args.model, "nf4", "cpu", sequence, loss_chunk=args.loss_chunk)
        row = {"sequence": sequence, "predicted_peak_bytes": predicted.peak_bytes}
        batch = fine_tuning.pattern_batch(model, sequence)
        optimizer = fine_tuning.optimizer_for(model, args.learning_rate)
        try:
            run = fine_tuning.train(model, batch, steps=LOSS_STEPS if index == 0 else TIMED_STEPS,
                                    learning_rate=args.learning_rate, optimizer=optimizer, progress=False,
                                    loss_chunk=args.loss_chunk)
        except torch.OutOfMemoryError:
            row["outcome"] = "out of memory"
            record["runs"].append(row)
            break
        finally:
            del optimizer
            loading.release_gpu(warn=False)
        row.update(outcome="trained", peak_bytes=run.peak_bytes, steps_per_second=run.steps_per_second,
                   losses=run.losses, skipped=run.skipped)
        record["runs"].append(row)
        print(f"{f'{cap:g} GB' if cap else 'the whole GPU'}, {sequence:,} tokens: {run}", flush=True)
    trained = [row["sequence"] for row in record["runs"] if row["outcome"] == "trained"]
    record["largest_sequence"] = max(trained, default=None)
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
