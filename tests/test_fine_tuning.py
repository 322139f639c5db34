"""LoRA through the real peft library on tiny, on the CPU: the PLE table stays on the CPU and frozen under the
wrapper, zero adapters change nothing bit for bit, adapters round-trip exactly, and the loss of the copy task falls."""

import pytest
import torch

from helpers import fine_tuning, loading, placement, planner, records

peft = pytest.importorskip("peft")

TABLE = "model.language_model.embed_tokens_per_layer"


def tiny(quant="bf16", ple="cpu"):
    return loading.load_model("tiny", quant=quant, ple=ple, device="cpu")


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def lora_b(model):
    return [module for name, module in model.named_modules() if name.endswith("lora_B.default")]


@pytest.fixture(scope="module")
def ids():
    return torch.randint(16, 272, (2, 24), generator=torch.Generator().manual_seed(1))


def test_plain_projection_names_also_catch_the_towers_and_peft_refuses_their_clippable_linears(tiny_path):
    # the usual target_modules=["q_proj", ...] reaches the vision and audio towers' Gemma4ClippableLinear
    with pytest.raises(ValueError, match="Gemma4ClippableLinear"):
        peft.get_peft_model(tiny(), peft.LoraConfig(r=4, target_modules=list(fine_tuning.PROJECTIONS)))


def test_lora_wraps_only_the_text_decoders_attention_and_mlp_projections(tiny_path):
    model = fine_tuning.add_adapters(tiny())
    wrapped = [name for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)]
    assert wrapped and all(".language_model.layers." in name for name in wrapped)
    assert {name.rsplit(".", 1)[-1] for name in wrapped} == set(fine_tuning.PROJECTIONS)
    assert not any(tower in name for name in wrapped for tower in ("vision_tower", "audio_tower", "embed"))
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    shown = fine_tuning.targets(model)
    assert sum(shown.wrapped.values()) == len(wrapped) and {"vision_tower", "audio_tower", placement.PLE_SUFFIX} <= set(shown.kept_out)


@pytest.mark.parametrize("quant", ["bf16", "nf4"])
def test_ple_cpu_survives_the_real_wrapper_frozen_on_the_cpu_with_no_offload_hook(tiny_path, quant):
    model = fine_tuning.add_adapters(fine_tuning.prepare(tiny(quant)))
    names = placement.ple_module_names(model)
    assert names == [f"base_model.model.{TABLE}"]
    table = model.get_submodule(names[0])
    assert table.weight.device.type == "cpu" and not table.weight.requires_grad
    assert placement.has_cpu_lookup(table) and not hasattr(table, "_hf_hook")
    assert "lookup on cpu" in str(placement.report(model))
    batch = fine_tuning.pattern_batch(model, 16)
    model.train()
    model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    assert table.weight.grad is None
    assert all(parameter.grad is not None for parameter in fine_tuning.trainable(model))


def test_offload_ple_finds_and_moves_the_table_under_the_real_peft_prefix(tiny_path, ids):
    from accelerate.hooks import attach_align_device_hook

    model = fine_tuning.add_adapters(tiny(ple="gpu"))  # the table in the model, as a GPU load leaves it
    table = model.get_submodule(f"base_model.model.{TABLE}")
    before = logits(model, ids)
    attach_align_device_hook(table, execution_device="cpu", offload=True, weights_map=table.state_dict())
    assert "offload hook" in str(placement.report(model))  # the control: a hook that copies the table is seen
    placement.offload_ple(model, "cpu")
    assert placement.has_cpu_lookup(table) and not hasattr(table, "_hf_hook") and table.weight.device.type == "cpu"
    assert "offload hook" not in str(placement.report(model))
    assert torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("quant", ["bf16", "nf4"])
def test_zero_adapters_leave_the_logits_bit_for_bit_and_a_nonzero_b_changes_them(tiny_path, ids, quant):
    base = tiny(quant)
    expected = logits(base, ids)
    model = fine_tuning.add_adapters(base)
    assert all(torch.count_nonzero(b.weight) == 0 for b in lora_b(model))  # peft's init: B = 0
    assert torch.equal(logits(model, ids), expected)
    with torch.no_grad():
        lora_b(model)[0].weight.fill_(0.05)  # the control: one adapter made non-zero
    assert not torch.equal(logits(model, ids), expected)
    with model.disable_adapter():  # and peft's own switch gives the base back exactly
        assert torch.equal(logits(model, ids), expected)


def perturbed(seed):
    model = fine_tuning.add_adapters(tiny(), seed=seed)
    with torch.no_grad():
        for b in lora_b(model):
            b.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    return model


def adapter_state(model):
    return {name: tensor.clone() for name, tensor in peft.get_peft_model_state_dict(model).items()}


def test_a_saved_adapter_loads_back_exactly_in_weights_and_logits(tiny_path, ids, tmp_path):
    trained = perturbed(seed=3)
    folder = fine_tuning.save_adapter(trained, tmp_path / "adapter")
    assert not list(tmp_path.glob("adapter.partial-*"))
    saved = adapter_state(trained)
    assert saved and all("lora_" in name for name in saved)  # the adapters alone: no base weight, no PLE table
    assert fine_tuning.adapter_bytes(folder) < 4 * sum(t.numel() for t in saved.values()) + 65536
    loaded = fine_tuning.load_adapter(tiny(), folder)
    again = adapter_state(loaded)
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)
    assert torch.equal(logits(loaded, ids), logits(trained, ids))
    other = perturbed(seed=4)  # the control: other adapters give other logits
    assert not torch.equal(logits(other, ids), logits(trained, ids))


@pytest.mark.parametrize("quant", ["bf16", "nf4"])
def test_an_adapter_loaded_beside_the_trained_one_gives_its_logits_on_the_same_base(tiny_path, ids, tmp_path, quant):
    model = fine_tuning.qlora("tiny", device="cpu", quant=quant)
    fine_tuning.train(model, fine_tuning.pattern_batch(model, 32), steps=2, learning_rate=1e-2, progress=False)
    folder = fine_tuning.save_adapter(model, tmp_path / "adapter")
    assert fine_tuning.load_beside(model, folder, "reloaded") == "reloaded" and model.active_adapters == ["reloaded"]
    reloaded = logits(model, ids)
    model.set_adapter("default")
    assert torch.equal(logits(model, ids), reloaded)
    with model.disable_adapter():  # the control: the base alone
        assert not torch.equal(logits(model, ids), reloaded)


def test_saving_again_replaces_the_folder_whole(tiny_path, tmp_path):
    folder = fine_tuning.save_adapter(perturbed(seed=3), tmp_path / "adapter")
    first = (folder / "adapter_model.safetensors").read_bytes()
    fine_tuning.save_adapter(perturbed(seed=5), folder)
    assert (folder / "adapter_model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


@pytest.mark.parametrize("quant", ["bf16", "nf4"])
def test_merging_folds_the_adapter_in_and_on_nf4_the_requantized_sum_is_farther_off(tiny_path, ids, quant):
    model = fine_tuning.add_adapters(tiny(quant))
    with torch.no_grad():
        for b in lora_b(model):
            b.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
    with_adapter = logits(model, ids)
    merged = fine_tuning.merge(model)
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
    error = (logits(merged, ids).float() - with_adapter.float()).abs().max().item()
    base_change = (logits(tiny(quant), ids).float() - with_adapter.float()).abs().max().item()
    assert error < base_change  # the merge keeps more of the adapter than dropping it would
    if quant == "nf4":
        bf16 = fine_tuning.add_adapters(tiny("bf16"))
        with torch.no_grad():
            for b in lora_b(bf16):
                b.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
        reference = logits(bf16, ids)
        bf16_error = (logits(fine_tuning.merge(bf16), ids).float() - reference.float()).abs().max().item()
        assert error > bf16_error


def test_prepare_for_kbit_training_casts_the_ple_table_to_fp32_and_the_course_prepare_does_not(tiny_path):
    ours = fine_tuning.prepare(tiny("nf4"))
    assert ours.get_submodule(TABLE).weight.dtype == torch.bfloat16
    expected = fine_tuning.upcast_bytes(ours)
    assert expected[TABLE] == ours.get_submodule(TABLE).weight.numel() * 2  # bf16 to fp32: 2 bytes more each
    theirs = fine_tuning.prepare(tiny("nf4"), upcast=True)  # peft.prepare_model_for_kbit_training
    assert theirs.get_submodule(TABLE).weight.dtype == torch.float32
    assert fine_tuning.upcast_bytes(theirs) == {}


def test_the_copy_task_loss_falls_and_with_a_zero_learning_rate_it_does_not(tiny_path):
    batch = fine_tuning.pattern_batch(planner.load_config("tiny"), 64)
    assert torch.equal(batch[0, :16], batch[0, 16:32]) and batch[0, :16].unique().numel() > 8
    run = fine_tuning.train(fine_tuning.qlora("tiny", device="cpu"), batch, steps=12, learning_rate=1e-2, progress=False)
    assert run.losses[-1] < run.losses[0] - 0.5 and not run.skipped
    still = fine_tuning.train(fine_tuning.qlora("tiny", device="cpu"), batch, steps=4, learning_rate=0.0, progress=False)
    assert len(set(still.losses)) == 1 and still.losses[0] == pytest.approx(run.losses[0])


def test_a_step_with_a_non_finite_loss_is_skipped_not_applied(tiny_path):
    model = fine_tuning.qlora("tiny", device="cpu")
    before = adapter_state(model)
    table = model.get_submodule(f"base_model.model.{TABLE}")
    with torch.no_grad():
        table.weight[:] = float("inf")  # what an fp16 overflow makes of the activations
    run = fine_tuning.train(model, fine_tuning.pattern_batch(model, 16), steps=2, progress=False)
    assert run.skipped == [0, 1]
    assert all(torch.equal(before[k], v) for k, v in adapter_state(model).items())


def test_the_planners_adapter_and_optimizer_terms_match_the_real_peft_model_and_optimizer(tiny_path):
    model = fine_tuning.qlora("tiny", device="cpu")
    real = sum(parameter.numel() for parameter in fine_tuning.trainable(model))
    estimate = planner.predict_training("tiny", sequence=32, optimizer="adamw")
    assert estimate.adapter_parameters == real
    assert estimate.terms["LoRA adapters (fp32)"] == sum(p.numel() * p.element_size() for p in fine_tuning.trainable(model))
    optimizer = fine_tuning.optimizer_for(model)
    fine_tuning.train(model, fine_tuning.pattern_batch(model, 32), steps=1, optimizer=optimizer, progress=False)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    assert estimate.terms["optimizer state (adamw)"] == state


def test_the_training_peak_grows_with_the_sequence_and_only_the_activation_terms_do():
    short, long = (planner.predict_training("e4b-shape", sequence=n, loss_chunk=None) for n in (512, 1024))
    assert long.peak_bytes > short.peak_bytes and short.peak_at == long.peak_at == planner.AT_THE_LOSS
    grew = {term for term in short.terms if long.terms[term] != short.terms[term]}
    assert grew == {"layer inputs kept by checkpointing", "logits, the loss and its gradient"}
    assert all(long.terms[term] == 2 * short.terms[term] for term in grew)  # what the shapes give is linear
    assert short.resident_bytes == planner.predict("e4b-shape", "nf4", "cpu", 512).resident_bytes


TRAINING_RECORDS = records.fine_tuning_records()
TRAINED = [(record, row) for record in TRAINING_RECORDS for row in record["runs"] if row["outcome"] == "trained"]


def test_the_training_calibration_file_is_exactly_what_the_fine_tuning_records_give():
    # no backward figure is typed by hand: rerunning the calibration reproduces the file
    assert planner.calibrate_training(TRAINING_RECORDS) == planner.load_training_calibration()


def test_the_fine_tuning_records_reach_long_sequences_where_the_backward_pass_peaks():
    # the fit needs steps the loss does not explain, and lengths past the cards' safe sequences
    fitted = next(iter(planner.load_training_calibration()["architectures"].values()))
    assert len(fitted["sequences"]) >= 5 and max(fitted["sequences"]) >= 16384
    assert {record["loss_chunk"] is None for record in TRAINING_RECORDS} == {True, False}


@pytest.mark.parametrize("record,row", TRAINED, ids=lambda x: f"{x['sequence']}" if "sequence" in x else
                         f"{x['card_gb'] or 'whole'}-{'chunked' if x['loss_chunk'] else 'whole-loss'}")
def test_the_planner_meets_every_recorded_training_peak_within_8_percent(record, row):
    estimate = planner.predict_training(record["model"], sequence=row["sequence"], loss_chunk=record["loss_chunk"])
    assert estimate.peak_bytes == pytest.approx(row["peak_bytes"], rel=0.08), str(estimate)


def test_without_the_measured_backward_the_planner_misses_the_long_recorded_steps():
    # the control: the shapes' terms alone, as the planner had them, fall short where the backward pass peaks
    long_rows = [(record, row) for record, row in TRAINED if record["loss_chunk"] and row["sequence"] >= 8192]
    assert long_rows
    for record, row in long_rows:
        shapes_only = planner.predict_training(record["model"], sequence=row["sequence"], loss_chunk=record["loss_chunk"],
                                               calibration=planner.EMPTY_TRAINING)
        assert shapes_only.peak_bytes < 0.85 * row["peak_bytes"], (row["sequence"], shapes_only.peak_bytes, row["peak_bytes"])


def test_a_short_chunked_step_peaks_at_the_loss_and_a_long_one_in_the_backward_pass():
    short, long = (planner.predict_training("e4b-shape", sequence=n) for n in (512, 16384))
    assert (short.peak_at, long.peak_at) == (planner.AT_THE_LOSS, planner.IN_THE_BACKWARD)
    measured = f"{planner.BACKWARD_TERM} (measured)"
    assert measured in long.terms and measured not in short.terms
    assert short.other_moment_bytes < short.peak_bytes and long.other_moment_bytes < long.peak_bytes
    quadruple = planner.predict_training("e4b-shape", sequence=4 * 16384).terms[measured]
    assert quadruple > 4 * long.terms[measured]  # the masks grow with n^2


def test_an_unmeasured_architecture_borrows_the_nearest_fit_scaled_and_says_so():
    profile = planner.backward_profile(planner.load_config("e2b-shape"))
    assert not profile.exact and "scaled" in profile.measured_on
    borrowed = planner.predict_training("e2b-shape", sequence=16384).terms
    assert f"{planner.BACKWARD_TERM} (scaled from e4b-shape)" in borrowed  # the learner sees it is borrowed
    with pytest.raises(FileNotFoundError, match="planner calibrate"):
        planner.backward_profile(planner.load_config("e2b-shape"), planner.EMPTY_TRAINING)


@pytest.mark.parametrize("profile", [planner.backward_profile, lambda config: planner.activation_profile(config, "nf4")])
def test_a_profile_reads_a_model_name_and_refuses_what_is_no_config_in_one_sentence(profile):
    assert profile("e4b-shape").exact
    from helpers.errors import CourseError

    for bad in (3, "no-such-model"):
        with pytest.raises(CourseError):
            profile(bad)


def test_calibrating_from_records_of_too_few_long_steps_fits_nothing():
    few = [dict(record, runs=[row for row in record["runs"] if row["sequence"] <= 4096]) for record in TRAINING_RECORDS]
    assert planner.calibrate_training(few)["architectures"] == {}


def test_a_chunked_loss_holds_one_chunks_logits_so_the_same_card_trains_a_longer_sequence():
    chunk = fine_tuning.LOSS_CHUNK
    whole, chunked = (planner.predict_training("e4b-shape", sequence=4 * chunk, loss_chunk=c) for c in (None, chunk))
    logits = {name: size for name, size in chunked.terms.items() if name.startswith("logits")}
    assert list(logits.values()) == [whole.terms["logits, the loss and its gradient"] // 4]
    short = planner.predict_training("e4b-shape", sequence=chunk // 2, loss_chunk=chunk)  # shorter than one chunk
    assert short.terms[next(iter(logits))] == whole.terms["logits, the loss and its gradient"] // 8
    eight_whole, eight_chunked = (planner.training_fits("e4b-shape", 8, loss_chunk=c) for c in (None, chunk))
    assert eight_chunked.safe_context > 2 * eight_whole.safe_context


def head_positions(model):
    """The positions of every call of the output head, forward and backward recompute alike."""
    seen = []
    head = model.get_base_model().lm_head if hasattr(model, "get_base_model") else model.lm_head
    handle = head.register_forward_hook(lambda module, args, out: seen.append(out.shape[1]))
    return seen, handle


def adapters_with_nonzero_b(model, seed=3):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_b(model):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
    return model


def test_the_chunked_loss_equals_the_models_own_loss_and_gradients_and_a_label_shift_is_told_apart(tiny_path, ids):
    model = adapters_with_nonzero_b(fine_tuning.add_adapters(fine_tuning.prepare(tiny())))
    labels = ids.clone()
    labels[0, 5:9] = -100  # skipped positions count in neither the sum nor the mean
    results = {}
    for name, chunk in (("own", None), ("chunked", 5)):  # 23 predicted positions: chunks of 5, 5, 5, 5, 3
        model.zero_grad(set_to_none=True)
        seen, handle = head_positions(model)
        loss = fine_tuning.causal_lm_loss(model, ids, labels, chunk=chunk)
        loss.backward()
        handle.remove()
        grads = torch.cat([p.grad.flatten() for p in fine_tuning.trainable(model)])
        results[name] = (loss.detach(), grads, seen)
    (own, own_grads, own_seen), (chunked, grads, seen) = results["own"], results["chunked"]
    assert own_seen == [ids.shape[1]] and seen[:5] == [5, 5, 5, 5, 3]
    assert seen[5:] == [3, 5, 5, 5, 5]  # each chunk made again in the backward pass, the last first
    assert torch.allclose(chunked, own, rtol=1e-5) and own_grads.abs().max() > 0
    assert torch.allclose(grads, own_grads, rtol=1e-3, atol=1e-6 * own_grads.abs().max().item())
    shifted = labels.roll(1, dims=1)  # the control: targets one position late
    with torch.no_grad():
        late = fine_tuning.causal_lm_loss(model, ids, shifted, chunk=5)
        other = fine_tuning.causal_lm_loss(model, ids.flip(1), chunk=5)
    assert abs(late - own) > 100 * abs(chunked - own) + 1e-3 and abs(other - own) > 1e-3


def test_training_with_the_chunked_loss_learns_the_copy_task_as_the_whole_loss_does(tiny_path):
    batch = fine_tuning.pattern_batch(planner.load_config("tiny"), 64)
    runs = {chunk: fine_tuning.train(fine_tuning.qlora("tiny", device="cpu"), batch, steps=6, learning_rate=1e-2,
                                     progress=False, loss_chunk=chunk) for chunk in (None, 16)}
    assert runs[16].loss_chunk == 16 and runs[None].loss_chunk is None
    assert runs[16].losses[0] == pytest.approx(runs[None].losses[0], rel=1e-5)
    assert runs[16].losses[-1] < runs[16].losses[0] - 0.5
    assert runs[16].losses == pytest.approx(runs[None].losses, rel=1e-2)


@pytest.mark.parametrize("bad, match", [
    (dict(chunk=0), "chunk"), (dict(chunk=2.5), "chunk"), (dict(input_ids=[1, 2, 3]), "2-D tensor of token ids"),
    (dict(input_ids=torch.ones(5, dtype=torch.long)), "2-D tensor"), (dict(labels=torch.ones(1, 3, dtype=torch.long)),
                                                                      "shaped like input_ids"),
    (dict(input_ids=torch.ones(1, 1, dtype=torch.long)), "at least 2"),
])
def test_a_bad_loss_input_is_one_sentence_before_any_work(tiny_path, bad, match):
    from helpers.errors import CourseError

    arguments = dict(input_ids=torch.ones(1, 8, dtype=torch.long), labels=None, chunk=4) | bad
    with pytest.raises(CourseError, match=match):
        fine_tuning.causal_lm_loss(tiny(), arguments.pop("input_ids"), **arguments)


def test_a_bigger_card_trains_longer_sequences_and_a_4_gb_card_none_on_e4b():
    eight, fifteen = (planner.training_fits("e4b-shape", gb) for gb in (8, 15))
    assert eight.loads and fifteen.safe_context > eight.safe_context >= 512
    assert not planner.training_fits("e4b-shape", 4).loads
    choice = planner.choose("10.train", "e4b-shape", card_gb=4)
    assert choice.model != "e4b-shape"


@pytest.mark.parametrize("bad", [dict(rank=0), dict(alpha=-1), dict(rank=2.5)])
def test_a_bad_lora_setting_is_one_sentence(bad):
    from helpers.errors import CourseError

    with pytest.raises(CourseError):
        fine_tuning.lora_config(**bad)
