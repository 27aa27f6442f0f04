"""The gke backend of experiments.launch: an indexed Job (one TPU slice or GPU node group) or
a JobSet of indexed Jobs (multi-slice TPU, the GKE way), applied with kubectl, and a wait
script that reads the job's conditions until it completes or fails.

    plan(opts, train_args, workdir, module)   # a launch_plans.Plan: files and steps
    gke_manifest(opts, train_args, tpu)        # the YAML documents
    tpu_hosts_per_slice(opts)                  # --tpu_topology's chips / --chips_per_host
"""

from __future__ import annotations

import math
import os
import re
import shlex
from typing import Any, Sequence

from experiments.launch_plans import (
    COMBINE_CODES_BASH,
    COORDINATOR_PORT,
    LaunchOptions,
    Plan,
    Process,
    base_env,
    check_name,
    launch_dir,
    require,
    train_argv,
)
from jaxrl4llm.config.errors import EXIT_PREEMPTED

KINDS = ("job", "jobset")
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "slice"  # a JobSet's replicated job: pod hostnames NAME-slice-J-I
MEGASCALE_PORT = 8080
# kubectl delete of a previous attempt: waits until its pods are gone (a preempted pod may
# still be saving its checkpoint when the job has failed).
DELETE = ("--ignore-not-found", "--cascade=foreground")
# Consecutive failed reads of the job's state before the wait gives up.
WAIT_TRIES = 10


def plan(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> Plan:
    """Writes the manifest and the wait script; runs `kubectl delete` (a previous attempt,
    its pods gone first: a preempted pod may still be saving), `kubectl apply`, then the
    wait script, whose exit code is the pods' combined one."""
    require(opts, "image", "accelerator", "chips_per_host")
    check_name(opts)
    tpu = opts.accelerator.startswith("tpu")
    _check_shape(opts, tpu)
    folder = launch_dir(opts, workdir)
    manifest = os.path.join(folder, f"{opts.name}.yaml")
    wait = os.path.join(folder, f"{opts.name}-wait.sh")
    files = {manifest: gke_manifest(opts, train_args, tpu, module), wait: wait_script(opts)}
    kubectl = ("kubectl", f"--namespace={opts.namespace}")
    steps = (
        (Process((*kubectl, "delete", *DELETE, "-f", manifest)),),
        (Process((*kubectl, "apply", "-f", manifest)),),
        (Process(("bash", wait)),),
    )
    return Plan(files=files, steps=steps, log_dir=f"kubectl logs --selector={_pod_label(opts)}")


def _check_shape(opts: LaunchOptions, tpu: bool) -> None:
    if opts.gke_kind not in KINDS:
        raise ValueError(f"--gke_kind={opts.gke_kind}: choose one of {', '.join(KINDS)}.")
    if opts.num_slices > 1 and (opts.gke_kind != "jobset" or not tpu):
        raise ValueError(
            f"--num_slices={opts.num_slices} needs --gke_kind=jobset and a TPU --accelerator "
            "(multi-slice TPU); GPU jobs and --gke_kind=job run one group of --num_hosts pods."
        )
    if tpu:
        require(opts, "tpu_topology")
        hosts = opts.num_slices * tpu_hosts_per_slice(opts)
        if opts.num_hosts != hosts:
            raise ValueError(
                f"--num_hosts={opts.num_hosts} does not match --tpu_topology={opts.tpu_topology}"
                f": its {_chips(opts.tpu_topology)} chips at --chips_per_host="
                f"{opts.chips_per_host} are {hosts // opts.num_slices} hosts per slice, x "
                f"--num_slices={opts.num_slices}: set --num_hosts={hosts} (the pods of "
                "another count would wait for nodes that never come)."
            )


def _chips(topology: str) -> int:
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){1,2}", topology):
        raise ValueError(
            f"--tpu_topology={topology!r} must be the slice's chips per dimension, e.g. 2x2x2 "
            "(v5p) or 2x4 (v5e)."
        )
    return math.prod(int(d) for d in topology.split("x"))


def tpu_hosts_per_slice(opts: LaunchOptions) -> int:
    """The hosts of one slice of --tpu_topology at --chips_per_host chips each."""
    chips = _chips(opts.tpu_topology)
    if chips % opts.chips_per_host:
        raise ValueError(
            f"--tpu_topology={opts.tpu_topology} has {chips} chips, not a multiple of "
            f"--chips_per_host={opts.chips_per_host}: give the chips of one TPU VM host "
            "(4 on v5p, 4 or 8 on v5e)."
        )
    return chips // opts.chips_per_host


def _pod_label(opts: LaunchOptions) -> str:
    if opts.gke_kind == "jobset":
        return f"jobset.sigs.k8s.io/jobset-name={opts.name}"
    return f"batch.kubernetes.io/job-name={opts.name}"


def _env(opts: LaunchOptions, tpu: bool) -> list[dict[str, Any]]:
    """The container's environment. TPU: GKE gives each pod its slice's worker id and
    hostnames (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES), which jax reads; several slices also get
    the MEGASCALE variables that join them, slice 0's first pod coordinating. GPU: pod 0
    through the headless Service coordinates."""
    env: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in base_env("tpu" if tpu else "cuda", opts)
    ]
    first = f"{opts.name}-{REPLICATED_JOB}-0-0" if opts.gke_kind == "jobset" else f"{opts.name}-0"
    if tpu and opts.num_slices > 1:
        job_index = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
        env += [
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{first}.{opts.name}"},
            {"name": "MEGASCALE_PORT", "value": str(MEGASCALE_PORT)},
            {"name": "MEGASCALE_NUM_SLICES", "value": str(opts.num_slices)},
            {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {"fieldPath": job_index}}},
        ]
    elif not tpu:
        env += [
            {"name": "JAX_COORDINATOR_ADDRESS", "value": f"{first}.{opts.name}:{COORDINATOR_PORT}"},
            {"name": "JAX_NUM_PROCESSES", "value": str(opts.num_hosts)},
        ]
    return env


def _job_spec(
    opts: LaunchOptions, train_args: Sequence[str], tpu: bool, module: str
) -> dict[str, Any]:
    """One indexed Job's spec: a pod per host of the slice, `backoffLimit: 0` (a failed pod
    fails the job; the launcher resubmits) and a pod failure policy that names a pod whose
    node was reclaimed (DisruptionTarget), which leaves no exit code to read."""
    train = shlex.join(train_argv(opts, train_args, module))
    if not tpu:
        train = f"JAX_PROCESS_ID=$JOB_COMPLETION_INDEX exec {train}"
    resource = "google.com/tpu" if tpu else "nvidia.com/gpu"
    key = "cloud.google.com/gke-tpu-accelerator" if tpu else "cloud.google.com/gke-accelerator"
    selector = {key: opts.accelerator}
    if tpu:
        selector["cloud.google.com/gke-tpu-topology"] = opts.tpu_topology
    container = {
        "name": "train",
        "image": opts.image,
        "command": ["bash", "-c", train],
        "env": _env(opts, tpu),
        "ports": [{"containerPort": COORDINATOR_PORT}],
        "resources": {"limits": {resource: opts.chips_per_host}},
    }
    pod: dict[str, Any] = {"restartPolicy": "Never", "nodeSelector": selector}
    if opts.gke_kind == "job":
        pod["subdomain"] = opts.name  # the headless Service: NAME-I.NAME
    if opts.grace_period_s:
        pod["terminationGracePeriodSeconds"] = opts.grace_period_s
    pod["containers"] = [container]
    hosts = opts.num_hosts // opts.num_slices
    return {
        "completionMode": "Indexed",
        "completions": hosts,
        "parallelism": hosts,
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}]
        },
        "template": {"spec": pod},
    }


def gke_manifest(
    opts: LaunchOptions, train_args: Sequence[str], tpu: bool, module: str = "experiments.train"
) -> str:
    """--gke_kind=job: a headless Service and an indexed Job (two YAML documents); jobset: a
    JobSet of --num_slices indexed Jobs (it makes its own headless Service), one node pool
    per slice, no restarts of its own (the launcher resubmits)."""
    import yaml

    meta = {"name": opts.name, "namespace": opts.namespace}
    spec = _job_spec(opts, train_args, tpu, module)
    if opts.gke_kind == "jobset":
        jobset: dict[str, Any] = {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta}
        if tpu:
            key = "alpha.jobset.sigs.k8s.io/exclusive-topology"
            jobset["metadata"] = {**meta, "annotations": {key: "cloud.google.com/gke-nodepool"}}
        jobset["spec"] = {
            "failurePolicy": {"maxRestarts": 0},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                {"name": REPLICATED_JOB, "replicas": opts.num_slices, "template": {"spec": spec}}
            ],
        }
        return yaml.safe_dump(jobset, sort_keys=False)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"clusterIP": "None", "selector": {"batch.kubernetes.io/job-name": opts.name}},
    }
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}
    return yaml.safe_dump_all([service, job], sort_keys=False)


WAIT_SCRIPT = """\
#!/bin/bash
# Waits for {kind}/{name} to complete or fail, reading its conditions every {poll} s, then
# exits with its pods' combined exit code: 75 when a pod was preempted (exit 75, or its node
# reclaimed: the DisruptionTarget rule), else the first failure; a failed job whose pods left
# no code exits 1.
set -u
K=(kubectl --namespace={namespace})
TRUE_CONDITIONS='{{range .status.conditions[?(@.status=="True")]}}{{.type}} {{end}}'
EXIT_CODES='{{range .items[*]}}{{.status.containerStatuses[0].state.terminated.exitCode}} {{end}}'
fails=0
while :; do
  if STATE=$("${{K[@]}}" get {kind}/{name} -o jsonpath="$TRUE_CONDITIONS"); then
    fails=0
    case " $STATE " in
      *" Complete "*|*" Completed "*) DONE=Complete; break ;;
      *" Failed "*) DONE=Failed; break ;;
    esac
  else
    fails=$((fails + 1))
    if [ "$fails" -ge {tries} ]; then
      echo "launch: kubectl could not read {kind}/{name} {tries} times in a row; not \\
waiting any longer (it may still run: kubectl get {kind}/{name})." >&2
      exit 1
    fi
  fi
  sleep {poll}
done
CODES=$("${{K[@]}}" get pods --selector={label} -o jsonpath="$EXIT_CODES")
{combine}
if [ "$DONE" = Failed ]; then
  REASONS=$("${{K[@]}}" get {jobs} -o jsonpath='{{..conditions[?(@.type=="Failed")].message}}')
  case "$REASONS" in *DisruptionTarget*) rc={preempted} ;; esac
  if [ "$rc" = 0 ]; then rc=1; fi
fi
echo "launch: {kind}/{name}: $DONE; the pods' exit codes: ${{CODES:-none}}"
exit $rc
"""


def wait_script(opts: LaunchOptions) -> str:
    """The bash script that waits for the Job or JobSet (WAIT_SCRIPT)."""
    jobset = opts.gke_kind == "jobset"
    jobs = f"jobs --selector={_pod_label(opts)}" if jobset else f"job/{opts.name}"
    return WAIT_SCRIPT.format(
        kind=opts.gke_kind,
        name=opts.name,
        namespace=shlex.quote(opts.namespace),
        poll=opts.poll_s,
        tries=WAIT_TRIES,
        label=_pod_label(opts),
        jobs=jobs,
        combine=COMBINE_CODES_BASH,
        preempted=EXIT_PREEMPTED,
    )
