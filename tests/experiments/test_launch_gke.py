"""GKE without a cluster: the manifests (indexed Job, JobSet) parsed as YAML and their fields
checked, the host count checked against the TPU topology, and the wait script run against a
stand-in kubectl that reports the job's conditions and its pods' exit codes."""

import os
import shlex
import subprocess
import sys

import pytest
import yaml

from experiments import launch_gke
from experiments.launch_backends import make_plan
from experiments.launch_plans import LaunchOptions

from tests.experiments.test_launch import REPO, TRAIN_ARGS, _tool

GPU = dict(backend="gke", name="rl1", image="img:1", accelerator="nvidia-h100-80gb")
TPU = dict(GPU, accelerator="tpu-v5p-slice", tpu_topology="2x2x2", chips_per_host=4)


def _documents(opts):
    plan = make_plan(opts, TRAIN_ARGS)
    manifest = next(text for path, text in plan.files.items() if path.endswith(".yaml"))
    return list(yaml.safe_load_all(manifest))


@pytest.mark.parametrize(
    "accelerator,topology,hosts,resource",
    [
        ("tpu-v5p-slice", "2x2x2", 2, "google.com/tpu"),
        ("nvidia-h100-80gb", "", 4, "nvidia.com/gpu"),
    ],
)
def test_gke_job_manifest_loads_with_the_fields_a_job_needs(
    tmp_path, accelerator, topology, hosts, resource
):
    opts = LaunchOptions(
        **dict(GPU, accelerator=accelerator),
        num_hosts=hosts,
        tpu_topology=topology,
        chips_per_host=4,
        grace_period_s=300,
        launch_dir=str(tmp_path),
    )
    service, job = _documents(opts)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == (
        "Indexed",
        hosts,
        hosts,
    )
    assert spec["backoffLimit"] == 0
    (rule,) = spec["podFailurePolicy"]["rules"]
    assert rule == {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "rl1"
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 300
    assert accelerator in pod["nodeSelector"].values()
    (container,) = pod["containers"]
    assert container["image"] == "img:1"
    assert container["resources"]["limits"] == {resource: 4}
    command = container["command"][2]
    assert shlex.split(command)[-len(TRAIN_ARGS) - 1 :] == ["--distributed", *TRAIN_ARGS]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["JAXRL4LLM_GRACE_PERIOD_S"] == "300"  # the trainer knows its grace period
    if resource == "nvidia.com/gpu":  # coordinator: pod 0 through the headless Service
        assert env["JAX_COORDINATOR_ADDRESS"] == "rl1-0.rl1:8476"
        assert env["JAX_NUM_PROCESSES"] == "4"
        assert "JAX_PROCESS_ID=$JOB_COMPLETION_INDEX" in command
    else:
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x2"
        assert env["JAX_PLATFORMS"] == "tpu" and "MEGASCALE_NUM_SLICES" not in env


def test_jobset_manifest_spans_slices(tmp_path):
    opts = LaunchOptions(
        **TPU, gke_kind="jobset", num_slices=3, num_hosts=6, launch_dir=str(tmp_path)
    )
    (jobset,) = _documents(opts)
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert jobset["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    spec = jobset["spec"]
    assert spec["failurePolicy"] == {"maxRestarts": 0}  # the launcher resubmits
    (replicated,) = spec["replicatedJobs"]
    assert (replicated["name"], replicated["replicas"]) == ("slice", 3)
    job = replicated["template"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    pod = job["template"]["spec"]
    assert "subdomain" not in pod  # JobSet names the pods NAME-slice-J-I under NAME
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x2"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "rl1-slice-0-0.rl1"
    assert env["MEGASCALE_NUM_SLICES"]["value"] == "3"
    slice_id = env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert slice_id == "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    # A GPU JobSet: one group, pod 0 of job 0 coordinates.
    opts = LaunchOptions(**GPU, gke_kind="jobset", num_hosts=2, chips_per_host=8)
    (jobset,) = _documents(opts)
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in container["containers"][0]["env"]}
    assert env["JAX_COORDINATOR_ADDRESS"] == "rl1-slice-0-0.rl1:8476"


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(num_hosts=5), "--num_hosts=5 does not match --tpu_topology=2x2x2"),
        (dict(num_hosts=2, num_slices=2, gke_kind="jobset"), "set --num_hosts=4"),
        (dict(num_hosts=2, tpu_topology="2x2x"), "--tpu_topology='2x2x' must be"),
        (dict(num_hosts=2, chips_per_host=3), "not a multiple of --chips_per_host=3"),
        (dict(num_hosts=4, num_slices=2), "--num_slices=2 needs --gke_kind=jobset"),
        (dict(num_hosts=2, gke_kind="pods"), "--gke_kind=pods: choose one of job, jobset"),
        (dict(num_hosts=2, name="RL_1"), "--name='RL_1'"),
    ],
)
def test_gke_shape_errors_name_the_flags(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        make_plan(LaunchOptions(**{**TPU, **changes}), TRAIN_ARGS)


def test_cli_host_count_against_topology_is_one_line_exit_2():
    bad = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "--backend=gke", "--image=img",
         "--accelerator=tpu-v5p-slice", "--tpu_topology=2x2x2", "--chips_per_host=4",
         "--num_hosts=5", "--dry_run", "--", *TRAIN_ARGS],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )  # fmt: skip
    assert bad.returncode == 2
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("Error: --num_hosts=5 does not match --tpu_topology=2x2x2")
    assert "2 hosts per slice" in line and "set --num_hosts=2" in line


KUBECTL = """\
echo "$*" >> "$FAKE/calls"
case "$*" in
  *"get pods"*) echo "$FAKE_CODES" ;;
  *message*) echo "$FAKE_REASON" ;;
  *" get "*)
    i=$(cat "$FAKE/reads" 2>/dev/null || echo 0); echo $((i + 1)) > "$FAKE/reads"
    IFS=, read -ra STATES <<< "$FAKE_STATES"
    state=${STATES[$i]-${STATES[-1]}}
    [ "$state" = ERR ] && { echo "error: the server is unreachable" >&2; exit 1; }
    printf '%s' "$state" ;;
esac
"""


def _wait(tmp_path, states, codes="", reason="", kind="job"):
    """Runs the plan's wait step against the stand-in kubectl: `states` is what each read of
    the job's true conditions returns, in turn (ERR: kubectl fails); returns (exit code,
    number of reads, stderr)."""
    fake = tmp_path / "fake"
    fake.mkdir(parents=True)
    _tool(fake, "kubectl", KUBECTL)
    extra = dict(gke_kind="jobset") if kind == "jobset" else {}
    opts = LaunchOptions(**GPU, num_hosts=2, chips_per_host=8, poll_s=0, **extra)
    opts = LaunchOptions(**{**opts.__dict__, "launch_dir": str(tmp_path)})
    plan = make_plan(opts, TRAIN_ARGS)
    for path, text in plan.files.items():
        open(path, "w").write(text)
    (wait,) = plan.steps[-1]
    env = dict(
        os.environ,
        PATH=f"{fake}:{os.environ['PATH']}",
        FAKE=str(fake),
        FAKE_STATES=states,
        FAKE_CODES=codes,
        FAKE_REASON=reason,
    )
    ran = subprocess.run(wait.argv, env=env, capture_output=True, text=True, timeout=30)
    reads = int((fake / "reads").read_text())
    assert all(f"get {kind}/rl1" in c for c in (fake / "calls").read_text().splitlines()[:reads])
    return ran.returncode, reads, ran.stderr


@pytest.mark.parametrize(
    "states,codes,reason,expected",
    [
        (",,Complete", "0 0 ", "", (0, 3)),  # no condition yet: it keeps reading
        (",FailureTarget,FailureTarget Failed", "1 75 ", "", (75, 3)),  # a pod preempted
        ("Failed", "3 ", "BackoffLimitExceeded", (3, 1)),
        # a reclaimed node's pod leaves no exit code; its Job's failure names the rule
        (
            "Failed",
            " ",
            "Pod default/rl1-1 has condition DisruptionTarget matching FailJob",
            (75, 1),
        ),
        ("Failed", " ", "BackoffLimitExceeded", (1, 1)),  # failed, no code: never success
        ("ERR,ERR,Complete", "0 0 ", "", (0, 3)),  # the API server away a while
    ],
)
def test_gke_wait_reads_the_job_conditions(tmp_path, states, codes, reason, expected):
    code, reads, _ = _wait(tmp_path, states, codes, reason)
    assert (code, reads) == expected


def test_gke_wait_gives_up_when_kubectl_keeps_failing_and_reads_jobsets(tmp_path):
    code, reads, stderr = _wait(tmp_path / "a", "ERR")
    assert (code, reads) == (1, launch_gke.WAIT_TRIES)
    assert "could not read job/rl1 10 times in a row" in stderr
    assert _wait(tmp_path / "b", ",Completed", "0 0 ", kind="jobset")[:2] == (0, 2)


def test_gke_resubmission_waits_for_the_old_pods(tmp_path):
    opts = LaunchOptions(**TPU, num_hosts=2, launch_dir=str(tmp_path))
    delete, apply, wait = (step[0].argv for step in make_plan(opts, TRAIN_ARGS).steps)
    assert "--cascade=foreground" in delete and apply[2] == "apply"
    assert wait[0] == "bash" and wait[1].endswith("rl1-wait.sh")
