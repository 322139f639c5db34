"""The planner (helpers.planner.predict / fits) against the benchmark's recorded H200 measurements.

The records come from `make bench PRESET=memory|cards` (data/measurements/); the activation
profiles from `python -m helpers.planner calibrate`. These tests read both; none needs a GPU."""

import pytest

from helpers import models, planner, records
from helpers.errors import InvalidChoiceError

RECORDS = records.latest_records()
CALIBRATION = planner.load_calibration()
LOADED = [r for r in RECORDS if r.get("resident_bytes") is not None and not r["configuration"].get("route")
          and not r["configuration"].get("name")]  # named (issue 15) configurations: chunked prefills, decoding modes
PREFILLS = [(r, p) for r in LOADED for p in r.get("prefill", []) if "peak_bytes" in p]
CARDS = [r for r in RECORDS if r.get("preset") == "cards" and r.get("max_context")]
# issue 15: chunked prefills, plain and tuned (make bench PRESET=long-context, long-context-8gb, long-context-cards)
CHUNKED = [(r, p) for r in RECORDS if r.get("preset") == "long-context" and r["configuration"]["name"] in ("plain", "tuned")
           for p in r.get("prefill", []) if "peak_bytes" in p]
CHUNKED_CARDS = [r for r in RECORDS if r.get("preset") in ("long-context-8gb", "long-context-cards") and r.get("max_context")
                 and not r["configuration"].get("allocator")]  # the planner's reserve was measured with the default allocator
EXPANDABLE = [r for r in RECORDS if r.get("preset") == "long-context-8gb" and r.get("max_context")
              and r["configuration"].get("allocator") == "expandable_segments:True"]


def label(record, point=None):
    c = record["configuration"]
    return f"{c['model']}-{c['quant']}-ple_{c['ple']}-card_{c['card_gb']}" + (f"-{point['context']}" if point else "")


def test_the_recorded_grid_covers_both_models_three_quantizations_and_both_placements():
    covered = {(r["configuration"]["model"], r["configuration"]["quant"], r["configuration"]["ple"])
               for r in LOADED if r["preset"] == "memory"}
    assert covered == {(m, q, p) for m in ("e4b-shape", "e2b-shape") for q in ("bf16", "int8", "nf4") for p in ("gpu", "cpu")}
    assert {r["configuration"]["card_gb"] for r in CARDS} == {8, 15, 16}


def test_the_calibration_file_is_exactly_what_the_records_give():
    # no activation figure is typed by hand: rerunning the calibration reproduces the file
    recomputed = planner.calibrate(RECORDS)
    assert recomputed["architectures"] == CALIBRATION["architectures"]
    assert recomputed["allocator_reserve"] == CALIBRATION["allocator_reserve"]
    assert recomputed["allocator_reserve_worst"] == CALIBRATION["allocator_reserve_worst"]


@pytest.mark.parametrize("record", LOADED, ids=label)
def test_predicted_resident_memory_is_within_5_percent_of_what_loading_allocated(record):
    c = record["configuration"]
    estimate = planner.predict(c["model"], c["quant"], c["ple"], 512, calibration=CALIBRATION)
    assert estimate.resident_bytes == pytest.approx(record["resident_bytes"], rel=0.05)


@pytest.mark.parametrize("record,point", PREFILLS, ids=lambda x: "" if isinstance(x, dict) and "context" in x else label(x))
def test_predicted_prefill_peak_is_within_10_percent_across_the_measured_grid(record, point):
    c = record["configuration"]
    estimate = planner.predict(c["model"], c["quant"], c["ple"], point["context"], calibration=CALIBRATION)
    assert estimate.peak_bytes == pytest.approx(point["peak_bytes"], rel=0.10), str(estimate)


@pytest.mark.parametrize("record", CARDS, ids=label)
def test_the_safe_context_never_promises_more_than_a_simulated_card_reached(record):
    c = record["configuration"]
    verdict = planner.fits(c["model"], c["card_gb"], c["quant"], c["ple"], calibration=CALIBRATION)
    assert verdict.loads
    assert verdict.safe_context <= record["max_context"] + 512  # the bisection's resolution
    assert verdict.safe_context >= 0.75 * record["max_context"]  # and is not uselessly cautious


@pytest.mark.parametrize("record", CARDS, ids=label)
def test_the_expected_largest_context_is_within_12_percent_of_the_bisected_one_on_each_simulated_card(record):
    # 12%, not the peak's 10%: under a cap the reachable context is step-like (a card 1 GB larger
    # can add several times the tokens the smooth profile predicts) and it moves between runs;
    # safe_context is the figure to act on
    c = record["configuration"]
    verdict = planner.fits(c["model"], c["card_gb"], c["quant"], c["ple"], calibration=CALIBRATION)
    assert verdict.max_context == pytest.approx(record["max_context"], rel=0.12)


def test_a_model_the_card_refused_to_load_is_predicted_not_to_load():
    refused = [r for r in RECORDS if r.get("preset") == "cards" and r.get("load_oom")]
    assert refused, "the 8 GB card with E4B's PLE on the GPU should be among the records"
    for record in refused:
        c = record["configuration"]
        assert not planner.fits(c["model"], c["card_gb"], c["quant"], c["ple"], calibration=CALIBRATION).loads


@pytest.mark.parametrize("ple", ["gpu", "cpu"])
def test_the_seed_issue_setup_nf4_with_the_ple_path_and_towers_in_bf16_is_reproduced(ple):
    seed_gb = planner.SEED_ISSUE[ple]["resident_gb"]
    estimate = planner.predict("e4b-shape", "nf4", ple, 8500, keep_bf16=planner.SEED_KEEP_BF16, calibration=CALIBRATION)
    plain = planner.predict("e4b-shape", "nf4", ple, 8500, calibration=CALIBRATION)
    assert estimate.resident_bytes / 1e9 == pytest.approx(seed_gb, rel=0.05)
    assert estimate.resident_bytes > plain.resident_bytes  # keeping modules in bf16 costs memory


def test_kv_cache_grows_only_through_full_attention_layers_once_past_the_sliding_window():
    config = models.load_config("e4b-shape")
    values = planner.config_values(config)
    window = values["sliding_window"]
    owners = values["layer_types"][: len(values["layer_types"]) - values["num_kv_shared_layers"]]
    full = sum(kind == "full_attention" for kind in owners)
    assert 0 < full < len(owners)
    growth = planner.kv_cache_bytes(config, 4 * window + 1000) - planner.kv_cache_bytes(config, 4 * window)
    per_full_layer = growth / 1000 / full
    assert per_full_layer == 2 * 2 * 512 * 2  # k and v, 2 kv heads, global head width 512, bf16
    assert planner.kv_cache_bytes(config, window) > planner.kv_cache_bytes(config, window // 2)


def test_accelerates_estimate_assumes_every_weight_is_4_bit_and_undercounts_nf4():
    ours = planner.predict("e4b-shape", "nf4", "gpu", 512, calibration=CALIBRATION).resident_bytes
    accelerate = planner.accelerate_estimate("e4b-shape", "nf4")
    assert accelerate < 0.5 * ours  # the PLE table and embeddings stay bf16 under bitsandbytes
    assert planner.accelerate_estimate("e4b-shape", "bf16") == pytest.approx(
        planner.predict("e4b-shape", "bf16", "gpu", 512, calibration=CALIBRATION).resident_bytes, rel=0.01)


def test_all_logits_adds_a_vocabulary_wide_row_per_prompt_token():
    short = planner.predict("e4b-shape", "nf4", "cpu", 8500, calibration=CALIBRATION)
    plain_forward = planner.predict("e4b-shape", "nf4", "cpu", 8500, all_logits=True, calibration=CALIBRATION)
    assert plain_forward.peak_bytes - short.peak_bytes == 8500 * 262144 * 2


def test_an_architecture_never_measured_borrows_a_scaled_profile_and_says_so(tiny_path):
    estimate = planner.predict(str(tiny_path), "nf4", "cpu", 1024, calibration=CALIBRATION)
    assert "scaled" in estimate.activations_from
    assert 0 < estimate.peak_bytes - estimate.resident_bytes


def test_bad_quantization_or_placement_names_the_choices():
    with pytest.raises(InvalidChoiceError, match="'nf4'"):
        planner.predict("e4b-shape", "q4", "cpu")
    with pytest.raises(InvalidChoiceError, match="'gpu', 'cpu'"):
        planner.predict("e4b-shape", "nf4", "disk")


def test_a_missing_calibration_names_the_commands_that_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="helpers.planner calibrate"):
        planner.load_calibration(tmp_path / "none.json")


def test_agreement_rows_cover_every_recorded_load_prefill_and_card():
    rows = planner.agreement(RECORDS, CALIBRATION)
    assert len(rows) == len(LOADED) + len(PREFILLS) + 2 * len(CARDS)  # each card: expected and safe
    assert max(abs(error) for what, _, _, error in rows if "resident" in what) < 0.05
    assert max(abs(error) for what, _, _, error in rows if "peak" in what) < 0.10
    assert max(error for what, _, _, error in rows if "safe context" in what) <= 0.02


HOST = planner.host_records()


@pytest.mark.parametrize("route,record", HOST, ids=[route for route, _ in HOST])
def test_predicted_host_memory_is_within_10_percent_of_the_anonymous_and_file_backed_peaks(route, record):
    c = record
    estimate = planner.predict_host(c["model"], c["quant"], "gpu" if route == "ple-gpu" or route == "post-load" else "cpu",
                                    offload_after_load=planner.HOST_ROUTES[route])
    assert estimate.anon_load_bytes == pytest.approx(record["host_load_anon_peak_bytes"], rel=0.10)
    assert estimate.anon_generate_bytes == pytest.approx(record["host_generate_anon_peak_bytes"], rel=0.10)
    assert estimate.file_load_bytes == pytest.approx(record["host_load_file_peak_bytes"], rel=0.10)


def test_the_table_copied_by_offload_ple_is_predicted_from_routes_that_never_copied_it():
    # out of sample: calibrated without the post-load route, the planner must still predict it
    without = planner.calibrate_host([(route, r) for route, r in HOST if route != "post-load"])
    post = dict(HOST)["post-load"]
    estimate = planner.predict_host(post["model"], post["quant"], "gpu", offload_after_load=True, calibration=without)
    assert estimate.anon_load_bytes == pytest.approx(post["host_load_anon_peak_bytes"], rel=0.10)
    assert estimate.anon_load_bytes > 5 * planner.predict_host(post["model"], post["quant"], "cpu", calibration=without).anon_load_bytes


def test_the_host_calibration_file_is_exactly_what_the_records_give():
    assert planner.calibrate_host(HOST) == planner.load_host_calibration()


def test_ple_on_cpu_fits_colab_ram_and_a_copied_table_leaves_less_room():
    from helpers import cards

    colab = cards.MACHINES_RAM["Colab (12.7 GB RAM)"]
    assert planner.host_fits(planner.predict_host("e4b-shape", "nf4", "cpu"), colab)
    copied = planner.predict_host("e4b-shape", "nf4", "gpu", offload_after_load=True)
    assert copied.anon_generate_bytes > planner.predict_host("e4b-shape", "nf4", "cpu").anon_generate_bytes + 5e9


def test_predicting_each_point_from_a_fit_without_it_stays_within_15_percent():
    # in-sample agreement flatters a fitted profile; this is the error on points the fit never saw
    held_out = planner.holdout(RECORDS)
    for kind, (in_sample, out_of_sample) in held_out.items():
        assert out_of_sample >= in_sample - 1e-9, kind  # leaving a point out cannot make the fit better on it
        assert out_of_sample < 0.15, (kind, out_of_sample)


# --------------------------------------------------------------------------- chunked prefill, plain and tuned

def test_the_tuned_chunked_prefill_is_predicted_to_save_exactly_the_repeated_and_concatenated_keys():
    for context in (8192, 131072):
        plain = planner.predict("e4b-shape", "nf4", "cpu", context, prefill_chunk=2048, path="plain", calibration=CALIBRATION)
        tuned = planner.predict("e4b-shape", "nf4", "cpu", context, prefill_chunk=2048, path="tuned", calibration=CALIBRATION)
        saved = (plain.terms["keys and values copied per query head (repeat_kv)"]
                 + plain.terms["history concatenated anew (DynamicLayer torch.cat)"])
        cache_difference = plain.terms["KV cache"] - tuned.terms["KV cache"]  # the window vs one token less, per layer
        assert plain.peak_bytes - tuned.peak_bytes == saved + cache_difference
        assert saved > 0


def test_a_chunked_prefill_holds_one_chunks_activations_whatever_the_context():
    short, long = (planner.predict("e4b-shape", "nf4", "cpu", n, prefill_chunk=2048, path="tuned", calibration=CALIBRATION)
                   for n in (8192, 131072))
    assert short.terms["activations of one chunk (measured profile)"] == long.terms["activations of one chunk (measured profile)"]
    one_shot = planner.predict("e4b-shape", "nf4", "cpu", 32768, calibration=CALIBRATION)
    chunked = planner.predict("e4b-shape", "nf4", "cpu", 32768, prefill_chunk=2048, calibration=CALIBRATION)
    assert chunked.peak_bytes < one_shot.peak_bytes  # chunks are the point of prefill_chunk_size


def test_the_planner_expects_the_tuned_path_to_reach_at_least_as_far_as_the_plain_one_on_every_card():
    for card in (8, 15, 16):
        plain = planner.fits("e4b-shape", card, "nf4", "cpu", 131072, prefill_chunk=2048, path="plain", calibration=CALIBRATION)
        tuned = planner.fits("e4b-shape", card, "nf4", "cpu", 131072, prefill_chunk=2048, path="tuned", calibration=CALIBRATION)
        assert tuned.max_context >= plain.max_context
    assert not planner.fits("e4b-shape", 8, "nf4", "cpu", 131072, prefill_chunk=2048, path="plain", calibration=CALIBRATION).fits


def test_a_decode_step_reads_every_weight_the_text_model_uses_and_no_tower():
    on_cpu = planner.decode_bytes_per_token("e4b-shape", "nf4", "cpu", 32)
    resident = planner.predict("e4b-shape", "nf4", "gpu", 512, calibration=CALIBRATION)
    towers = sum(size for part, size in resident.weights_by_part.items() if "tower" in part)
    assert towers > 0 and on_cpu == planner.decode_bytes_per_token("e4b-shape", "nf4", "gpu", 32)  # the PLE gives one row
    assert on_cpu < resident.resident_bytes - towers  # the PLE table is not read whole
    assert planner.decode_bytes_per_token("e4b-shape", "nf4", "cpu", 32768) > on_cpu  # and the keys of every position


@pytest.mark.parametrize("kwargs, message", [({"path": "fast"}, "choose one of"), ({"prefill_chunk": 0}, "whole number"),
                                             ({"prefill_chunk": 2048.5}, "whole number")])
def test_bad_chunked_prefill_settings_are_refused_in_one_sentence(kwargs, message):
    with pytest.raises(InvalidChoiceError, match=message):
        planner.predict("tiny", "nf4", "cpu", 512, **kwargs)


def test_a_checkpoint_on_a_ram_disk_counts_as_page_cache_not_as_nothing(monkeypatch):
    # a checkpoint on /dev/shm is mapped as shared memory (RssShmem), not RssFile: both are page cache
    from helpers import host_memory

    monkeypatch.setattr(host_memory, "current", lambda: {"anon_bytes": 5, "file_bytes": 40, "shmem_bytes": 10_000})
    sampler = host_memory.PeakSampler()
    sampler._sample()
    assert (sampler.peaks.anon_bytes, sampler.peaks.file_bytes) == (5, 10_040)


def test_the_chunked_prefill_records_cover_both_paths_to_131072_and_every_card():
    assert {(r["configuration"]["name"], p["context"]) for r, p in CHUNKED} == {
        (path, n) for path in ("plain", "tuned") for n in (8192, 16384, 32768, 65536, 131072)}
    assert {(r["configuration"]["path"], r["configuration"]["card_gb"]) for r in CHUNKED_CARDS} == {
        ("plain", 8), ("tuned", 8), ("tuned", 15), ("tuned", 16)}


def chunked_label(item):
    return f"{item['configuration']['name']}" if "configuration" in item else str(item.get("context", ""))


@pytest.mark.parametrize("record,point", CHUNKED, ids=chunked_label)
def test_the_planner_predicts_the_plain_and_the_tuned_chunked_prefill_within_10_percent(record, point):
    c = record["configuration"]
    estimate = planner.predict(c["model"], c["quant"], c["ple"], point["context"], prefill_chunk=c["prefill_chunk"],
                               path=c["path"], calibration=CALIBRATION)
    assert estimate.peak_bytes == pytest.approx(point["peak_bytes"], rel=0.10), str(estimate)


def chunked_verdict(record):
    c = record["configuration"]
    return planner.fits(c["model"], c["card_gb"], c["quant"], c["ple"], record["max_context"],
                        prefill_chunk=c["prefill_chunk"], path=c["path"], calibration=CALIBRATION)


@pytest.mark.parametrize("record", CHUNKED_CARDS, ids=lambda r: r["configuration"]["name"])
def test_the_planner_brackets_a_chunked_context_between_its_safe_and_its_unfragmented_figure(record):
    # the plain path's reach moves between runs with fragmentation (on 8 GB two runs fell 10% and 13% short of
    # the median-margin figure): what holds is the bracket, worst margin below, no margin above
    verdict = chunked_verdict(record)
    assert verdict.safe_context <= record["max_context"] + 512 <= verdict.unfragmented_context + 1024  # 2 x resolution
    if record["configuration"]["path"] == "tuned":  # no growing history to fragment: the median margin holds
        assert verdict.max_context == pytest.approx(record["max_context"], rel=0.12)


@pytest.mark.parametrize("record", EXPANDABLE, ids=lambda r: r["configuration"]["name"])
def test_expandable_segments_reach_the_context_the_planner_expects_with_no_fragmentation_within_5_percent(record):
    verdict = chunked_verdict(record)
    assert record["max_context"] == pytest.approx(verdict.unfragmented_context, rel=0.05)
    assert record["max_context"] > verdict.max_context or record["max_context"] == record["max_context_limit"]


def test_the_expandable_records_include_the_plain_path_where_fragmentation_costs_context():
    assert {r["configuration"]["path"] for r in EXPANDABLE} == {"plain", "tuned"}


# what each live step of the notebooks runs on a card (planner.choose), for every card size a learner may own
EVERY_CARD_GB = [gb / 2 for gb in range(8, 49)]  # 4 to 24 GB in half-gigabyte steps, not only the named cards
PLENTY_OF_RAM = 64e9


@pytest.mark.parametrize("model", ["e4b-shape", "e2b-shape"])
def test_on_every_card_from_4_gb_each_step_runs_something_that_fits_it(model):
    for card_gb in EVERY_CARD_GB:
        for step, wanted in planner.STEPS.items():
            choice = planner.choose(step, model, card_gb=card_gb, ram_bytes=PLENTY_OF_RAM)
            assert choice, (card_gb, choice.reason)  # the synthetic shapes end in tiny, which fits every card
            verdict = planner.fits(choice.model, card_gb, choice.quant, choice.ple, choice.context, wanted.keep_bf16,
                                   towers=choice.towers, head=choice.head)
            assert verdict.loads and verdict.fits, (card_gb, step, choice.reason)
            assert choice.setup in map(planner.full_setup, wanted.setups) and choice.context >= planner.MIN_CONTEXT


@pytest.mark.parametrize("card_gb", [4, 6, 8, 15, 24])
def test_a_step_runs_the_model_itself_whenever_it_loads_and_a_smaller_sibling_only_when_it_does_not(card_gb):
    for step, wanted in planner.STEPS.items():
        if wanted.model:  # a step of its own model: the test below
            continue
        choice = planner.choose(step, "e4b-shape", card_gb=card_gb, ram_bytes=PLENTY_OF_RAM)
        setups = [planner.full_setup(setup) for setup in wanted.setups]
        itself = [planner.fits("e4b-shape", card_gb, quant, ple, wanted.context, wanted.keep_bf16, towers=towers, head=head)
                  for quant, ple, towers, head in setups]
        runs = [v.fits or (v.loads and (v.safe_context or 0) >= planner.MIN_CONTEXT) for v in itself]
        assert (choice.model == "e4b-shape") == any(runs), (card_gb, choice.reason)
        if choice.model == "e4b-shape" and any(v.fits for v in itself):  # the most wanted setup that fits whole
            assert setups.index(choice.setup) == [v.fits for v in itself].index(True)


def test_a_model_with_no_smaller_sibling_that_does_not_fit_runs_nothing_and_says_why_in_one_sentence():
    choice = planner.choose("05.reference", "tiny", card_gb=0.5, ram_bytes=PLENTY_OF_RAM)  # tiny has no sibling
    assert not choice and choice.model is None
    assert choice.reason.startswith(planner.STEPS["05.reference"].title + " does not run live here: tiny, nf4, PLE on gpu")
    assert "GB with headroom and 0.5 GB free" in choice.reason and choice.reason.count(". ") == 0


def test_a_step_cuts_its_own_models_prompt_to_what_fits_before_it_turns_to_a_sibling():
    wanted = planner.STEPS["09.long"]
    card = next(gb for gb in EVERY_CARD_GB if planner.fits("e4b-shape", gb, "nf4", "cpu", 2048).fits)
    assert not planner.fits("e4b-shape", card, "nf4", "cpu", wanted.context).fits
    choice = planner.choose("09.long", "e4b-shape", card_gb=card, ram_bytes=PLENTY_OF_RAM)
    assert choice.model == "e4b-shape" and 2048 <= choice.context < wanted.context and "prompts up to" in choice.reason
    assert planner.fits("e4b-shape", card, "nf4", "cpu", choice.context).fits


def test_a_step_that_needs_more_host_memory_than_there_is_runs_something_smaller():
    roomy = planner.choose("02.reference", "e4b-shape", card_gb=24, ram_bytes=PLENTY_OF_RAM)
    cramped = planner.choose("02.reference", "e4b-shape", card_gb=24, ram_bytes=3e9)
    assert roomy.model == "e4b-shape" and cramped.model != "e4b-shape", cramped.reason


def test_on_the_cpu_every_step_runs_the_model_itself():
    plan = planner.course_plan("tiny", "cpu", ram_bytes=PLENTY_OF_RAM)
    assert all(choice.model == "tiny" for choice in plan.choices) and len(plan.choices) == len(planner.STEPS)
    assert "from records" not in str(plan)


def test_the_course_plan_names_every_step_and_what_it_runs_on_a_card():
    plan = planner.course_plan("e4b-shape", card_gb=4, ram_bytes=PLENTY_OF_RAM)
    text, html = str(plan), plan._repr_html_()
    assert text.startswith("On a 4 GB card") and all(step in text and step in html for step in planner.STEPS)
    assert "e2b-shape" in text  # E4B does not fit a 4 GB card with its headroom


@pytest.mark.parametrize("kwargs, message", [
    (dict(step="99.nothing"), "choose one of"),
    (dict(step="05.reference", card_gb=-1), "card_gb"),
    (dict(step="05.reference", context=0), "context"),
    (dict(step="05.reference", ram_bytes="lots"), "ram_bytes"),
])
def test_bad_choices_are_refused_in_one_sentence(kwargs, message):
    from helpers.errors import CourseError

    with pytest.raises(CourseError, match=message):
        planner.choose(model="tiny", **kwargs)


def test_a_cards_decode_range_is_bounded_by_its_bandwidth_or_by_the_steps_other_time():
    from helpers.cards import Card

    # 1 GB a token on a 1,000 GB/s recording GPU at 100 tokens/s: 1 ms reading, 9 ms other time
    record = {"decode_tokens_per_s": 100.0, "bytes_read_per_token": 1e9, "copy_bandwidth_bytes_per_s": 1e12}
    slow = planner.decode_range(record, Card("slow card", 8, 50))  # 20 ms reading
    fast = planner.decode_range(record, Card("fast card", 8, 2000))  # 0.5 ms reading
    assert slow.bound == "bandwidth" and fast.bound == "latency"
    assert slow.fastest_tokens_per_s == pytest.approx(50) and slow.slowest_tokens_per_s == pytest.approx(1 / 0.029)
    assert fast.fastest_tokens_per_s == pytest.approx(1 / 0.009) and fast.slowest_tokens_per_s == pytest.approx(1 / 0.0095)
    # the recording GPU itself comes back to the recorded speed at the slow end
    assert planner.decode_range(record, Card("itself", 8, 1000)).slowest_tokens_per_s == pytest.approx(100)


def test_a_decode_record_without_its_bytes_or_bandwidth_is_refused_in_one_sentence():
    from helpers.cards import Card
    from helpers.errors import CourseError

    with pytest.raises(CourseError, match="bytes_read_per_token"):
        planner.decode_range({"decode_tokens_per_s": 70.0}, Card("RTX 4060", 8, 272))


def test_a_step_of_its_own_model_shows_that_model_whichever_the_learner_chose_and_stays_out_of_the_plan():
    for chosen in ("e4b-shape", "e2b-shape", "tiny"):
        assert planner.choose("09.host-free", chosen, card_gb=4).model == "tiny"
    assert planner.choose("09.decode", "e4b-shape", card_gb=8).model == "e4b-shape"  # the control: a step of the learner's model
    plan = planner.course_plan("e4b-shape", card_gb=8, ram_bytes=64e9)
    assert {choice.model for choice in plan.choices if choice.step == "09.host-free"} == {"tiny"}


def test_the_host_prediction_table_sets_the_planner_beside_each_measured_route():
    table = planner.host_predictions()
    measured = dict(planner.host_records())
    assert [row[0] for row in table.rows] == list(measured) and len(measured) >= 3
    for route, predicted, recorded in table.rows:
        assert float(recorded) == round(measured[route]["host_generate_anon_peak_bytes"] / 1e9, 2)
        assert abs(float(predicted) - float(recorded)) <= 0.25 * float(recorded)  # the post-load copy included


def test_each_learner_card_gets_one_row_per_recorded_step_and_a_step_without_its_bytes_is_left_out():
    fast = {"decode_tokens_per_s": 200.0, "bytes_read_per_token": 1e9, "copy_bandwidth_bytes_per_s": 2e12}
    slow = {**fast, "decode_tokens_per_s": 50.0}
    table = planner.decode_on_cards({"slow step": slow, "fast step": fast, "unmeasured": {"decode_tokens_per_s": 90.0}})
    assert table.columns == ("card", "slow step", "fast step")
    assert [row[0].split(" (")[0] for row in table.rows] == list(planner.DECODE_CARDS)
    on_4060 = dict(zip(table.columns, next(row for row in table.rows if row[0].startswith("RTX 4060 ("))))
    # 1 GB at 272 GB/s is 3.7 ms; the slow step's other time (19.5 ms) bounds it, the fast step's (4.5 ms) too
    assert on_4060["slow step"] == "43-51 tokens/s, latency-bound" and on_4060["fast step"].endswith("latency-bound")
    assert not planner.decode_on_cards({"unmeasured": {"decode_tokens_per_s": 90.0}})


@pytest.mark.parametrize("modes, message", [("cudagraphs", "not a tuple"), (("no-such-mode",), "not a mode")])
def test_a_card_table_for_a_mode_the_run_does_not_have_is_refused_in_one_sentence(modes, message):
    from helpers.errors import CourseError

    if message == "not a mode" and not records.preset_records("decode-goal"):
        pytest.fail("the decode-goal run is recorded in data/measurements: this test reads it")
    with pytest.raises(CourseError, match=message):
        planner.recorded_decode_on_cards("decode-goal", modes)
