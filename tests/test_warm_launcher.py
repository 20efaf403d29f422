"""The tests' warm launcher (tests/warm_launcher.py) against real launches: each rank's environment, per shipped
config, is the one `accelerate launch` gives it, so an accelerate or torch upgrade that changes what a launch sets
cannot drift the warm runs silently; a failed rank ends the others as torchrun's agent ends them; what it cannot
start is refused, and the caller launches for real."""

import concurrent.futures
import json
import os
import sys

import pytest
from conftest import (
    BIN,
    CONFIGS,
    REPO,
    command_environment,
    free_port,
    launch_command,
    run,
    two_machines,
    warm_server,
)


# Each names one launch, not what it is: torchrun's error file lies in a folder of the launch's own, and mlflow (which
# the launcher imports) draws a session id per process.
PER_LAUNCH = {"TORCHELASTIC_ERROR_FILE", "_MLFLOW_TELEMETRY_SESSION_ID"}
PROBE = """import json, os, sys
with open(os.path.join(sys.argv[1], os.environ.get("RANK", "0") + ".json"), "w") as out:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path}, out)
"""
SHIPPED = sorted(path.name for path in CONFIGS.glob("*.yaml"))
SINGLE_MACHINE = [name for name in SHIPPED if not name.startswith("multi_node") and name != "single.yaml"]
# launched for real: a rank reads their pipeline and expert-parallel sizes from its launcher's command line
UNEXPORTED = ("pp.yaml", "dp_pp.yaml", "ep.yaml", "fsdp_ep.yaml")
WARM = [name for name in SINGLE_MACHINE if name not in UNEXPORTED]


def probe_argv(config: str, out, probe, port: int) -> list[str]:
    return ["--config_file", str(CONFIGS / config), "--main_process_port", str(port), str(probe), str(out)]


def read_ranks(folder) -> list[dict]:
    return [json.loads((folder / f"{rank}.json").read_text()) for rank in range(len(list(folder.iterdir())))]


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """{config: (each rank under a real launch, each rank under the warm launcher (None where it refuses the config),
    the server's import-time variables)} for every single-machine config, each on its own processes."""
    root = tmp_path_factory.mktemp("warm_env")
    probe = root / "probe.py"
    probe.write_text(PROBE)
    server = warm_server()
    if server is None:
        pytest.skip("the warm launcher is off here (a GPU host, or RECIPES_TESTS_REAL_LAUNCHES)")
    ports = {config: free_port() for config in SINGLE_MACHINE}
    env = command_environment()
    for config in SINGLE_MACHINE:
        (root / "real" / config).mkdir(parents=True)
        (root / "warm" / config).mkdir(parents=True)
    # a plain launch of every shipped config, as a user types it (accelerate-launch: `accelerate launch`'s entry
    # point), two at a time: the launcher's imports are most of each
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        launched = {
            config: pool.submit(
                run, [BIN / "accelerate-launch", *probe_argv(config, root / "real" / config, probe, ports[config])]
            )
            for config in SINGLE_MACHINE
        }
        for config, future in launched.items():
            assert future.result().returncode == 0, config
    for config in WARM:
        result = server.launch(probe_argv(config, root / "warm" / config, probe, ports[config]), REPO, env)
        assert result is not None and result.returncode == 0, (config, server.refusal, result and result.stderr)
    return {
        config: (
            read_ranks(root / "real" / config),
            read_ranks(root / "warm" / config) if config in WARM else None,
            server.ready["imported"],
        )
        for config in SINGLE_MACHINE
    }


@pytest.mark.slow
def test_every_single_machine_config_runs_under_a_plain_launch(probed):
    """accelerate-launch (`accelerate launch`'s entry point) of each shipped single-machine config starts the
    processes the config asks for, each with its rank."""
    import yaml

    for config in SINGLE_MACHINE:
        processes = yaml.safe_load((CONFIGS / config).read_text())["num_processes"]
        assert sorted(r["env"]["RANK"] for r in probed[config][0]) == [str(rank) for rank in range(processes)], config


@pytest.mark.slow
@pytest.mark.parametrize("config", WARM)
def test_each_rank_gets_a_real_launchs_environment(probed, config):
    """Every variable a real launch gives a rank (accelerate's ACCELERATE_*/FSDP_*/PARALLELISM_CONFIG_*, torchrun's
    RANK ... TORCHELASTIC_*, OMP_NUM_THREADS, PYTHONPATH), with its value, and no other; the same argv, working folder
    and sys.path. The warm ranks also hold what the server's imports set (torch's inductor
    cache folder), as a rank that imported them itself would."""
    real, warm, imported = probed[config]
    assert len(real) == len(warm) > 1
    for rank, (mine, theirs) in enumerate(zip(warm, real)):
        env = {key: value for key, value in mine["env"].items() if key not in imported or key in theirs["env"]}
        assert set(env) ^ set(theirs["env"]) <= PER_LAUNCH, (rank, sorted(set(env) ^ set(theirs["env"])))
        differing = {k: (env[k], theirs["env"][k]) for k in set(env) & set(theirs["env"]) - PER_LAUNCH}
        differing = {k: v for k, v in differing.items() if v[0] != v[1]}
        assert not differing, (rank, differing)
        # the same command line but for the folder the probe writes to (each launch its own)
        argv = [arg.replace(f"warm{os.sep}{config}", f"real{os.sep}{config}") for arg in mine["argv"]]
        assert (argv, mine["cwd"], mine["path"]) == (theirs["argv"], theirs["cwd"], theirs["path"])
    assert [r["env"]["RANK"] for r in warm] == [str(rank) for rank in range(len(warm))]


@pytest.mark.slow
def test_a_failed_rank_ends_the_others_and_the_launch_exits_1(tmp_path):
    """Rank 1 exits 3 at once while rank 0 would sleep ten minutes: rank 0 is ended by SIGTERM (as torchrun's agent
    ends the others), the launch exits 1, as `accelerate launch` does after torchrun's ChildFailedError."""
    script = tmp_path / "fails.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(600)\n")
    server = warm_server()
    if server is None:
        pytest.skip("the warm launcher is off here (a GPU host, or RECIPES_TESTS_REAL_LAUNCHES)")
    argv = ["--config_file", str(CONFIGS / "ddp.yaml"), "--main_process_port", str(free_port()), str(script)]
    result = server.launch(argv, REPO, command_environment(), timeout=60)
    assert result.returncode == 1 and result.rank_returncodes == [-15, 3], result.rank_returncodes


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, launcher_args, env",
    [
        ("single.yaml", [], {}),  # accelerate's simple launcher: one process, no torchrun
        ("pp.yaml", [], {}),
        ("ep.yaml", [], {}),
        ("multi_node_zero3.yaml", [], {}),  # its machines from the config alone
        ("multi_node_ddp.yaml", ["--machine_rank", "0"], {}),
        ("ddp.yaml", ["--max_restarts", "1", "--rdzv_backend", "c10d"], {}),
        ("ddp.yaml", [], {"HF_HUB_OFFLINE": "0"}),  # read at import: the server holds its own value
    ],
)
def test_what_it_cannot_start_is_refused_and_launched_for_real(config, launcher_args, env, tmp_path):
    server = warm_server()
    if server is None:
        pytest.skip("the warm launcher is off here (a GPU host, or RECIPES_TESTS_REAL_LAUNCHES)")
    argv = ["--config_file", str(CONFIGS / config), "--main_process_port", str(free_port()), *launcher_args]
    assert server.launch([*argv, str(tmp_path / "never.py")], REPO, command_environment(env), 60, list(env)) is None
    assert server.refusal


@pytest.mark.slow
def test_the_tests_launch_goes_through_it(tmp_path):
    """conftest's `launch` of a config the warm launcher starts is a warm launch (its result carries each rank's
    status), not a refused one launched for real."""
    from conftest import launch

    if warm_server() is None:
        pytest.skip("the warm launcher is off here (a GPU host, or RECIPES_TESTS_REAL_LAUNCHES)")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    result = launch("fsdp.yaml", probe, [tmp_path])
    assert getattr(result, "rank_returncodes", None) == [0, 0], result.args
    assert sorted(p.name for p in tmp_path.glob("?.json")) == ["0.json", "1.json"]


def test_make_launches_through_it_where_a_test_asks():
    """make's LAUNCH is what runs the recipe targets: given the warm launcher's client, `make causal_lm` runs it with
    accelerate launch's arguments (the client refuses without the test session's server)."""
    client = f"{sys.executable} {REPO / 'tests' / 'warm_launcher.py'}"
    dry = run(["make", "-n", "causal_lm", f"LAUNCH={client}", "CONFIG=accelerate_configs/fsdp.yaml"]).stdout
    assert f"{client} --config_file accelerate_configs/fsdp.yaml recipes/causal_lm.py" in dry
    refused = run([sys.executable, REPO / "tests" / "warm_launcher.py", "--config_file", "x"], check=False,
                  env={"WARM_LAUNCHER_SOCKET": ""})  # fmt: skip
    assert refused.returncode == 2 and "WARM_LAUNCHER_SOCKET is not set" in refused.stderr
    assert os.path.exists(REPO / "tests" / "warm_launcher.py")


@pytest.mark.slow
@pytest.mark.parametrize("config", [name for name in SHIPPED if name.startswith("multi_node")])
def test_each_multi_node_template_runs_under_a_plain_launch_as_two_machines(config, tmp_path):
    """The multi-node templates (which the warm launcher refuses) launched for real as two machines on loopback, one
    process each, as docs/operating.md starts them: both machines' ranks start, each with its rank of the two."""
    import subprocess

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    port = free_port()
    nodes = [
        subprocess.Popen(
            launch_command(config, probe, [tmp_path], two_machines(rank, "127.0.0.1", port)),
            cwd=REPO,
            env=command_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [output[-3000:] for output in outputs]
    written = sorted(path.name for path in tmp_path.glob("?.json"))
    assert written == ["0.json", "1.json"], written
    for rank in (0, 1):
        env = json.loads((tmp_path / f"{rank}.json").read_text())["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == (str(rank), "2", str(rank)), config
