"""predict: a model's fit and decode speed on a Mac from its config and
safetensors headers, against a local Hub serving a real-size 235B-shaped
repo of sparse files (headers over holes)."""

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_streaming.predict.__main__ import main as predict_main
from mlx_streaming.predict.curves import HitCurve, builtin_curve, trace_curve
from mlx_streaming.predict.headers import read_model
from mlx_streaming.predict.machines import MACHINES, machine
from mlx_streaming.predict.plan import fit, whole_budget_fit
from mlx_streaming.predict.shape import model_shape
from mlx_streaming.predict.speed import forecast
from mlx_streaming.runtime.memory import bytes_per_slot
from mlx_streaming.testing.hubserver import HubServer
from mlx_streaming.testing.sparse_repo import write_sparse_repo

REPO = "org/Qwen3-235B-A22B-4bit"
PUBLISHED = json.loads((__import__("pathlib").Path(__file__).parents[2] / "mlx_streaming"
                        / "predict" / "data" / "published.json").read_text())
QWEN_235B = PUBLISHED["models"]["Qwen3-235B-A22B-4bit"]["config"]


@pytest.fixture(scope="module")
def sparse_235b(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen235b")
    total = write_sparse_repo(root, QWEN_235B)
    assert total > 130e9  # a real-size model, on a few hundred KB of disk
    return root


@pytest.fixture(scope="module")
def hub(sparse_235b):
    with HubServer({REPO: sparse_235b}) as server:
        yield server


def run(capsys, *argv):
    status = predict_main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def predicted(capsys, hub, *argv):
    status, out, err = run(capsys, REPO, "--endpoint", hub.url, "--json", *argv)
    assert status == 0, err
    return json.loads(out)


def test_a_235b_repo_is_predicted_from_under_2mb_of_headers(capsys, hub):
    before, sent = len(hub.log), hub.state.bytes_sent
    r = predicted(capsys, hub, "--budget", "70GB", "--machine", "m5-max-128gb")
    gets = [q for q in hub.log[before:] if q.method == "GET"]
    shards = [q for q in gets if q.path.endswith(".safetensors")]
    assert shards and all(q.range is not None for q in shards)
    assert 0 < r["fetched_bytes"] <= hub.state.bytes_sent - sent < 2e6
    assert r["fits"] is True
    assert (r["moe_layers"], r["experts_per_layer"], r["top_k"]) == (94, 128, 8)
    low, high = r["decode_tok_s_band"]
    assert 0 < low <= r["decode_tok_s"] <= high
    assert isinstance(r["slots_per_layer"], int)


def test_the_slots_are_what_the_budget_holds(sparse_235b):
    """The loader's plan: the pools take what the spine leaves of the
    budget, to within one slot across all layers."""
    shape = model_shape(read_model(str(sparse_235b)))
    per_slot = bytes_per_slot(shape.manifest)
    for budget in (30, 70, 90):
        plan = fit(shape, machine("m5-max-128gb"), budget, 4096).plan
        spine = plan.base + plan.pinned_bytes + plan.ring
        assert spine + plan.slots * per_slot <= budget * 1e9 < spine + (plan.slots + 1) * per_slot


def test_more_memory_is_more_slots_and_more_speed(capsys, sparse_235b):
    rows = []
    for budget in ("40", "70", "90"):
        _, out, _ = run(capsys, str(sparse_235b), "--budget", budget,
                             "--machine", "m5-max-128gb", "--json")
        rows.append(json.loads(out))
    assert [r["slots_per_layer"] for r in rows] == sorted({r["slots_per_layer"] for r in rows})
    assert rows[0]["decode_tok_s"] < rows[1]["decode_tok_s"] < rows[2]["decode_tok_s"]
    assert rows[0]["fetched_bytes"] == 0  # a local directory


def test_approximate_routing_forecasts_misses_only_where_a_token_must_read(capsys,
                                                                          sparse_235b):
    """Only the router's own top ``keep`` can miss (cache-aware fills the
    rest from resident experts, the baselines drop or skip them): misses
    per token scale by keep / top-k, and the forecast says its output is
    approximate."""
    def forecast_of(*flags):
        _, out, err = run(capsys, str(sparse_235b), "--budget", "70", "--machine",
                          "m5-max-128gb", "--json", *flags)
        assert not err
        return json.loads(out)

    exact = forecast_of()
    assert exact["routing"]["approximate"] is False and exact["routing"]["keep"] == 8
    for flags, keep in [(["--routing", "cache-aware"], 4), (["--routing", "top-k-cut",
                        "--routing-keep", "6"], 6), (["--routing", "skip-misses"], 1)]:
        r = forecast_of(*flags)
        assert r["routing"]["approximate"] and r["routing"]["keep"] == keep
        assert r["misses_per_token"] == pytest.approx(exact["misses_per_token"] * keep / 8)
        assert r["routing"]["exact_misses_per_token"] == pytest.approx(
            exact["misses_per_token"])
        assert r["decode_tok_s"] > exact["decode_tok_s"] == pytest.approx(
            r["routing"]["exact_decode_tok_s"])
        assert r["hit_rate"] == exact["hit_rate"]  # the kept ones hit as exact's do
    assert forecast_of("--routing", "cache-aware")["routing"]["window"] == 16
    # Keeping all 8 is exact for cache-aware routing.
    assert forecast_of("--routing", "cache-aware", "--routing-keep", "8")["decode_tok_s"] == \
        pytest.approx(exact["decode_tok_s"])
    status, out, _ = run(capsys, str(sparse_235b), "--budget", "70", "--machine",
                         "m5-max-128gb", "--routing", "skip-misses")
    assert status == 0 and "APPROXIMATE" in out and "exact routing:" in out


@pytest.mark.parametrize("flags, says", [
    (["--routing", "top-k-cut", "--routing-keep", "8"], "changes nothing"),
    (["--routing-keep", "2"], "routing_keep is a setting of approximate routing"),
    (["--routing", "skip-misses", "--routing-window", "4"], "routing_window is a setting"),
])
def test_a_routing_the_runtime_refuses_is_refused_in_one_line(capsys, sparse_235b, flags,
                                                               says):
    status, _, err = run(capsys, str(sparse_235b), "--budget", "70", "--machine",
                         "m5-max-128gb", *flags)
    assert status != 0 and says in err and "Traceback" not in err


def test_a_budget_below_the_spine_does_not_fit_and_names_the_least(capsys, hub):
    r = predicted(capsys, hub, "--budget", "3GB", "--machine", "m5-max-128gb")
    assert r["fits"] is False and r["slots_per_layer"] is None
    assert r["least_budget_gb"] > 3 and "--budget" in r["refusal"]
    again = predicted(capsys, hub, "--budget", str(r["least_budget_gb"]),
                      "--machine", "m5-max-128gb")
    assert again["fits"] is True
    # The least budget streams spine layers, which every token reads.
    assert again["spine_gb_read_per_token"] > 0 and again["plan"]["streamed_layers"]
    status, out, _ = run(capsys, REPO, "--endpoint", hub.url, "--budget", "3",
                         "--machine", "m5-max-128gb")
    assert status == 0 and "DOES NOT FIT" in out and f"{r['least_budget_gb']:g} GB" in out


def test_a_machine_too_small_for_any_budget_says_so(capsys, hub):
    r = predicted(capsys, hub, "--budget", "20", "--machine", "m2-air-24gb",
                  "--context", "10000000")
    assert r["fits"] is False


def test_an_unknown_machine_lists_the_known_ones(capsys, hub):
    status, _, err = run(capsys, REPO, "--endpoint", hub.url, "--budget", "70",
                         "--machine", "m9-ultra")
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert all(name in err for name in MACHINES)


def test_a_repo_without_weights_or_config_is_one_line_naming_it(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_235B))
    status, _, err = run(capsys, str(tmp_path), "--budget", "70", "--machine", "m5-max-128gb")
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert "safetensors" in err
    (tmp_path / "config.json").write_text("{not json")
    status, _, err = run(capsys, str(tmp_path), "--budget", "70", "--machine", "m5-max-128gb")
    assert status == 1 and "config.json" in err and len(err.strip().splitlines()) == 1


def test_a_header_that_is_not_safetensors_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_235B))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    status, _, err = run(capsys, str(tmp_path), "--budget", "70", "--machine", "m5-max-128gb")
    assert status == 1 and "model.safetensors" in err and len(err.strip().splitlines()) == 1


def test_without_the_network_a_repo_id_is_a_clear_error_and_nothing_is_cached(
        capsys, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    status, out, err = run(capsys, REPO, "--endpoint", closed, "--budget", "70",
                           "--machine", "m5-max-128gb")
    assert status == 1 and out == "" and "reach" in err
    assert not any(tmp_path.rglob("*"))


def test_a_trace_routing_always_to_the_same_experts_always_hits(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"tok": t, "layers": [[1, 5], [2, 7]]}) + "\n"
                             for t in range(40)))
    curve = trace_curve(str(trace), "lru")
    assert curve.top_k == 2 and all(h == 1.0 for h in curve.hits)


def test_the_built_in_curves_rise_with_the_resident_share_and_say_whence():
    for policy in ("lru", "lfu-decay", "adaptive"):
        c = builtin_curve(policy)
        assert list(c.hits) == sorted(c.hits) and 0.3 < c.hits[0] < c.hits[-1] < 1
        assert "OLMoE" in c.name and policy in c.name
    notice = (__import__("pathlib").Path(__file__).parents[2] / "mlx_streaming" / "predict"
              / "data" / "NOTICE.md").read_text()
    assert "Apache-2.0" in notice and "sqliteai/warp" in notice


def test_a_curve_carries_to_a_wider_choice_with_more_hits():
    c = HitCurve("t", "lru", 64, 8, (0.25, 0.5), (0.5, 0.8))
    assert c.carried(0.25, 64, 8) == c.hit_rate(0.25) == 0.5
    assert c.carried(0.25, 128, 8, carry=0.0) == 0.5 < c.carried(0.25, 128, 8)
    assert c.carried(0.25, 128, 8, carry=1.0) == 0.8 and c.carried(1.0, 128, 8) == 1.0


def test_the_forecasts_meet_the_published_m5_max_rows(tmp_path):
    """The validation of docs/predict.md: within 25% on every M5 Max row
    (those runtimes page every call, with every expert resident too)."""
    shapes = {}
    for name, m in PUBLISHED["models"].items():
        write_sparse_repo(tmp_path / name, m["config"])
        shapes[name] = model_shape(read_model(str(tmp_path / name)))
    checked = 0
    for row in PUBLISHED["rows"]:
        if row["machine"] != "m5-max-128gb":
            continue
        shape, mac = shapes[row["model"]], machine(row["machine"])
        slots = (_published_slots(row, shape, mac) if "budget_gb" in row
                 else round(row["resident"] * shape.experts))
        f = forecast(shape, mac, slots, builtin_curve("lru"), paged=True)
        assert 0.75 <= f.tok_s / row["published_tok_s"] <= 1.25, row
        checked += 1
    assert checked == 5


def _published_slots(row, shape, mac) -> int:
    counts = row["budget_counts"]
    return whole_budget_fit(shape, mac, row["budget_gb"], counts["context"],
                            counts["headroom_gb"]).plan.slots


def test_a_published_budget_counts_what_its_runtime_counted(tmp_path):
    """boyle's budget holds the spine, the slots, the KV cache at 8192
    tokens and 4 GB of headroom: Qwen3-30B-A3B at 12 GB keeps 38% of its
    experts, not the 68% this runtime's --budget 12 would."""
    m = PUBLISHED["models"]["Qwen3-30B-A3B-4bit"]
    write_sparse_repo(tmp_path / "q", m["config"])
    shape, mac = model_shape(read_model(str(tmp_path / "q"))), machine("m1-pro-32gb")
    (row, *_) = [r for r in PUBLISHED["rows"] if r.get("budget_gb") == 12]
    assert _published_slots(row, shape, mac) == 49
    assert fit(shape, mac, 12, 0).plan.slots == 87
    assert all(r["source"].startswith("https://") for r in PUBLISHED["rows"])


def test_here_uses_this_machines_cached_measurement(capsys, sparse_235b, tmp_path, monkeypatch):
    from mlx_streaming.predict.here import cache_file

    monkeypatch.setenv("HOME", str(tmp_path))
    cache_file().parent.mkdir(parents=True)
    cache_file().write_text(json.dumps(dict(
        memory_gb=256, measured_gbps=300.0, ssd_gbps=5.0, disk_note="4 MB reads",
        host="testhost", at="then")))
    status, out, _ = run(capsys, str(sparse_235b), "--budget", "70", "--here", "--json")
    r = json.loads(out)
    assert status == 0 and r["machine"] == "this machine (testhost)" and r["fits"]
    cache_file().write_text(json.dumps(dict(json.loads(cache_file().read_text()),
                                            ssd_gbps=10.0)))
    _, out, _ = run(capsys, str(sparse_235b), "--budget", "70", "--here", "--json")
    assert json.loads(out)["decode_tok_s"] > r["decode_tok_s"]  # a faster disk, read again


def test_a_run_says_where_its_speed_fell_against_the_forecast(qwen, capsys, tmp_path):
    """predict on a converted stream directory, then generate with its
    forecast: the measured speed placed against the band."""
    import subprocess
    import sys

    src, stream_dir = qwen
    for model in (src, stream_dir):  # an mlx-lm directory and a stream directory agree
        status, out, err = run(capsys, str(model), "--budget", "0.02", "--machine",
                               "m4-pro-48gb", "--json", "--context", "256")
        assert status == 0, err
        r = json.loads(out)
        assert r["fits"] and r["experts_per_layer"] > r["top_k"] > 0
    forecast, stats = tmp_path / "forecast.json", tmp_path / "stats.json"
    forecast.write_text(out)
    proc = subprocess.run([sys.executable, "-m", "mlx_streaming.generate", "--model",
                           str(stream_dir), "--prompt", "def f(x):", "--max-tokens", "8",
                           "--slots-per-layer", str(r["slots_per_layer"]), "--forecast",
                           str(forecast), "--stats-json", str(stats)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    a = json.loads(stats.read_text())["summary"]["forecast"]
    measured = json.loads(stats.read_text())["summary"]["generation_tps"]
    assert a["ratio"] == pytest.approx(measured / r["decode_tok_s"]) and a["same_slots"]
    low, high = r["decode_tok_s_band"]
    assert a["where"] == ("below the band" if measured < low else "above the band"
                          if measured > high else "inside the band")
    assert a["where"] in proc.stderr
    forecast.write_text("{}")
    bad = subprocess.run([sys.executable, "-m", "mlx_streaming.generate", "--model",
                          str(stream_dir), "--forecast", str(forecast)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "predict --json" in bad.stderr


def test_a_stream_repo_is_predicted_from_its_manifest(qwen, capsys):
    _, stream_dir = qwen
    with HubServer({"org/tiny-stream": stream_dir}) as server:
        status, out, err = run(capsys, "org/tiny-stream", "--endpoint", server.url,
                               "--budget", "0.02", "--machine", "m4-pro-48gb", "--json")
        blobs = [q for q in server.log if q.path.endswith(".blob")]
    assert status == 0, err
    r = json.loads(out)
    local = json.loads(run(capsys, str(stream_dir), "--budget", "0.02", "--machine",
                           "m4-pro-48gb", "--json")[1])
    assert not blobs and r["fetched_bytes"] > 0  # the manifest, never a record
    assert r["slots_per_layer"] == local["slots_per_layer"] and r["fits"]


def test_bench_decode_places_each_case_against_the_forecast(qwen, capsys, tmp_path):
    from mlx_streaming.bench.__main__ import main as bench_main

    _, stream_dir = qwen
    status, out, err = run(capsys, str(stream_dir), "--budget", "0.02", "--machine",
                           "m4-pro-48gb", "--json", "--context", "256")
    assert status == 0, err
    forecast = tmp_path / "forecast.json"
    forecast.write_text(out)
    assert bench_main(["decode", "--model", str(stream_dir), "--pools", "0.5", "--max-tokens",
                       "4", "--routing-tokens", "8", "--forecast", str(forecast),
                       "--out", str(tmp_path / "d")]) == 0
    rows = json.loads((tmp_path / "d" / "decode.json").read_text())["rows"]
    band = json.loads(out)["decode_tok_s_band"]
    placed = [r for r in rows if r.get("decode_tps")]
    assert placed and all(r["vs_forecast"] == pytest.approx(
        r["decode_tps"] / json.loads(out)["decode_tok_s"]) for r in placed)
    assert all(r["forecast_where"] == ("below the band" if r["decode_tps"] < band[0] else
                                       "above the band" if r["decode_tps"] > band[1] else
                                       "inside the band") for r in placed)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=40), st.one_of(
           st.none(), st.integers(), st.text(max_size=5),
           st.fixed_dictionaries({"dtype": st.one_of(st.sampled_from(["U32", "BF16", "F8_E4M3"]),
                                                     st.integers()),
                                  "shape": st.lists(st.one_of(st.integers(-2, 300),
                                                              st.floats(), st.text(max_size=2)),
                                                    max_size=4)})), max_size=6),
       config=st.dictionaries(st.sampled_from(["num_experts", "num_experts_per_tok",
                                               "num_hidden_layers", "head_dim", "layer_types",
                                               "text_config", "sliding_window"]),
                              st.one_of(st.integers(-3, 300), st.text(max_size=3), st.none(),
                                        st.lists(st.text(max_size=3), max_size=3)),
                              max_size=7))
def test_fuzz_headers_and_configs_answer_or_refuse_in_one_line(capsys, tmp_path_factory, header,
                                                               config):
    root = tmp_path_factory.mktemp("fuzz")
    text = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text)
    (root / "config.json").write_text(json.dumps(config))
    status, out, err = run(capsys, str(root), "--budget", "1", "--machine", "m4-pro-48gb")
    assert (status, err) == (0, "") or (status == 1 and len(err.strip().splitlines()) == 1
                                        and err.startswith("error: ")), err
