"""The ``disttrain`` console script: one entry point, one small function per subcommand.

Subcommands import their heavy dependencies (kopf, kubernetes, rich) lazily, so ``disttrain crd`` and
``disttrain validate`` work with the base install.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from disttrain.api import constants, crd, pulse, validation
from disttrain.common import httpserver

if TYPE_CHECKING:
    from disttrain.operator import access, election, leaderlease


def agent_heartbeat_seconds(chosen: Optional[float], pulse_s: float) -> float:
    """The agents' Lease period: the one chosen, else none while they pulse (the pulse finds a lost agent in about a
    second with no API write, where a Lease renewed every second costs 60 writes per job-minute), else the default."""
    if chosen is not None:
        return chosen
    return 0.0 if pulse_s > 0 else constants.AGENT_LEASE_RENEW_SECONDS


def _non_negative_seconds(text: str) -> float:
    """An argparse type: seconds, 0 or more (a clear error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 (off) or a positive number of seconds")
    return value


def _pulse_key(path: str) -> dict[str, bytes]:
    """``AgentSettings``' pulse key from ``--agent-pulse-key-file`` (nothing: a key of this process's own); a file
    that cannot be read, or holds no key, stops the operator with a one-line error naming it."""
    if not path:
        return {}
    try:
        with open(path, encoding="ascii") as file:
            return {"pulse_key": pulse.parse_key(file.read())}
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--agent-pulse-key-file {path}: {exc}") from None


def cmd_crd(args: argparse.Namespace) -> int:
    """Print the CustomResourceDefinition rendered from the models."""
    sys.stdout.write(crd.render_crd())
    return 0


EXPORT_MODULE = "disttrain.trainer.checkpoint.export"
"""``disttrain export`` runs there, in a Python of its own: it needs torch, which this CLI never imports."""


def cmd_export(argv: Sequence[str]) -> int:
    """Hand ``disttrain export ARGS`` to the trainer's exporter (same interpreter), or say what is missing."""
    missing = [name for name in ("torch", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"disttrain export needs {' and '.join(missing)}: pip install 'disttrain[trainer,export]'",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, "-m", EXPORT_MODULE, *argv])


def cmd_validate(args: argparse.Namespace) -> int:
    """Check manifests with the CRD's rules plus the plan rules; print every problem with its field path (at most
    ``validation.MAX_PRINTED_PROBLEMS`` lines per file, then how many more)."""
    failed = 0
    for name in args.files:
        try:
            documents = list(validation.load_documents(pathlib.Path(name)))
        except validation.ManifestError as error:
            print(error, file=sys.stderr)
            failed += 1
            continue
        printed, hidden = 0, 0
        for source, obj in documents:
            problems = validation.validate_object(obj)
            errors = [p for p in problems if p.severity is validation.Severity.ERROR]
            lines = [(f"{source}: {p}", p in errors) for p in problems] or [(f"{source}: valid", False)]
            for line, is_error in lines:
                if printed < validation.MAX_PRINTED_PROBLEMS:
                    print(line, file=sys.stderr if is_error else sys.stdout)
                    printed += 1
                else:
                    hidden += 1
            if errors:
                failed += 1
            elif problems:
                if printed < validation.MAX_PRINTED_PROBLEMS:
                    print(f"{source}: valid")
                    printed += 1
                else:
                    hidden += 1
        if hidden:
            print(f"{name}: ... and {hidden} more problems", file=sys.stderr)
    return 1 if failed else 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Turn Kubeflow PyTorchJob manifests into DistTrainJobs (YAML on stdout, notes on stderr)."""
    import yaml

    from disttrain.operator import convert

    contract = convert.Contract(
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        max_steps=args.max_steps,
        max_samples=args.max_samples,
        checkpoint_claim=args.checkpoint_claim,
        checkpoint_volume=args.checkpoint_volume,
        batch_policy=args.batch_policy,
        lr_scaling=args.lr_scaling,
        checkpoint_path=args.checkpoint_path,
        checkpoint_interval_steps=args.checkpoint_interval_steps,
        seed=args.seed,
    )
    missing = contract.missing()
    if missing:
        print("a PyTorchJob has no training contract; give these (disttrain convert --help):", file=sys.stderr)
        for line in missing:
            print(f"  {line}", file=sys.stderr)
        return 2
    try:
        documents = list(validation.load_documents(pathlib.Path(args.file)))
    except validation.ManifestError as error:
        print(error, file=sys.stderr)
        return 1
    outputs: list[dict[str, object]] = []
    failed = False
    for source, obj in documents:
        try:
            result = convert.convert(obj, contract)
        except convert.ConversionError as error:
            print(f"{source}: {error}", file=sys.stderr)
            failed = True
            continue
        for note in result.notes:
            print(f"{source}: note: {note}", file=sys.stderr)
        errors = [p for p in validation.validate_object(result.objects[0]) if p.severity is validation.Severity.ERROR]
        for problem in errors:
            print(f"{source}: converted job: {problem}", file=sys.stderr)
        failed |= bool(errors)
        outputs += result.objects
    if failed:
        return 1
    sys.stdout.write(yaml.safe_dump_all(outputs, sort_keys=False))
    return 0


def network_policy_settings(args: argparse.Namespace) -> access.NetworkPolicySettings:
    """The operator's NetworkPolicy flags, checked before anything starts (a ValueError names the flag)."""
    from disttrain.operator.access import NetworkPolicySettings, parse_label_selector

    return NetworkPolicySettings(
        enabled=args.network_policy == "on",
        scraper_namespace_selector=parse_label_selector(
            "--metrics-scraper-namespace-selector", args.metrics_scraper_namespace_selector
        ),
        scraper_pod_selector=parse_label_selector("--metrics-scraper-pod-selector", args.metrics_scraper_pod_selector),
        operator_namespace=args.operator_namespace,
        operator_pod_selector=parse_label_selector("--operator-pod-selector", args.operator_pod_selector),
    )


def leader_election_options(args: argparse.Namespace) -> Optional[leaderlease.ElectionOptions]:
    """The Lease the replicas elect their leader on (None: no election, this process acts alone)."""
    from disttrain.operator.leaderlease import ElectionOptions, ElectionTiming  # pure: kubernetes not imported yet

    if not args.leader_election_lease:
        return None
    namespace = args.leader_election_namespace or args.operator_namespace
    if not namespace:
        raise ValueError("--leader-election-lease needs --leader-election-namespace (or --operator-namespace)")
    timing = ElectionTiming(
        lease_s=args.leader_election_lease_seconds,
        renew_deadline_s=args.leader_election_renew_deadline_seconds,
        retry_s=args.leader_election_retry_seconds,
    )
    identity = args.leader_election_identity or socket.gethostname()
    return ElectionOptions(namespace=namespace, name=args.leader_election_lease, identity=identity, timing=timing)


def cmd_operator(args: argparse.Namespace) -> int:
    """Run the kopf operator (``kopf.run`` underneath) until SIGINT/SIGTERM."""
    try:
        network = network_policy_settings(args)
        election_options = leader_election_options(args)
    except ValueError as error:
        print(f"disttrain operator: {error}", file=sys.stderr)
        return 2
    import logging
    import os

    if args.kubeconfig:  # before kubernetes is imported: it reads $KUBECONFIG at import time
        os.environ["KUBECONFIG"] = args.kubeconfig
    import kopf
    from kubernetes import client, config

    from disttrain.operator import election, gcpolicy, handlers, pods
    from disttrain.operator.metrics import OperatorMetrics

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )

    def kube_configuration() -> client.Configuration:
        """--kubeconfig, else in-cluster, else the default kubeconfig (as kopf logs in)."""
        configuration = client.Configuration()
        if args.kubeconfig:
            config.load_kube_config(config_file=args.kubeconfig, client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return configuration

    def api_client() -> client.ApiClient:
        """The adapter's client, one pooled connection per thread; its writes are fenced under leader election."""
        configuration = kube_configuration()
        configuration.connection_pool_maxsize = handlers.API_CONCURRENCY
        if elector is None:
            return client.ApiClient(configuration)
        return election.FencedApiClient(configuration, elector)

    leader = election.leader_gauge()
    elector: Optional[election.Elector] = None
    if election_options is not None:
        elector = election.Elector(client.ApiClient(kube_configuration()), election_options, leader)

    registry = kopf.get_default_registry()  # carries kopf's own login handlers (in-cluster, kubeconfig)
    agent = pods.AgentSettings(
        image=args.agent_image or None,
        heartbeat_s=agent_heartbeat_seconds(args.agent_heartbeat_seconds, args.agent_pulse_seconds),
        pulse_s=args.agent_pulse_seconds,
        **_pulse_key(args.agent_pulse_key_file),
    )
    instance = election_options.identity if election_options is not None else handlers.DEFAULT_INSTANCE
    handlers.register(
        registry, handlers.OperatorHandlers(api_client, OperatorMetrics(), agent, network=network, instance=instance)
    )

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: object) -> None:
        handlers.configure(settings)

    if args.metrics_port:
        httpserver.serve_metrics(args.metrics_port, args.metrics_address)  # bounded: connections and timeouts
    try:
        if elector is None:
            leader.set(1)
        else:  # a standby: nothing of kopf runs until this process holds the Lease
            # Until kopf's own handlers replace it, a SIGTERM (a rolling update) ends the process through the
            # release below, not by the default action that would leave a Lease just taken held for a whole lease.
            signal.signal(signal.SIGTERM, _stop_before_kopf)
            standby = election.StandbyHealth(args.liveness) if args.liveness else None
            # The kubernetes client imports its API classes at first use, seconds on a busy node: import the
            # adapter's now (a throwaway Kube, no thread started), not after the takeover.
            handlers.Kube(client.ApiClient(kube_configuration()))
            elector.acquire()
            if standby is not None:
                standby.close()
            elector.keep()
        gcpolicy.start()
        kopf.run(
            registry=registry,
            clusterwide=args.all_namespaces,
            namespaces=args.namespace or (),
            standalone=True,
            liveness_endpoint=args.liveness or None,
        )
    finally:
        if elector is not None:
            elector.release()
    return 0


def _stop_before_kopf(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disttrain", description="Elastic distributed PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p_crd = sub.add_parser("crd", help="print the DistTrainJob CustomResourceDefinition (YAML)")
    p_crd.set_defaults(func=cmd_crd)

    p_validate = sub.add_parser("validate", help="validate DistTrainJob manifests; exit 1 on any error")
    p_validate.add_argument("files", nargs="+", metavar="FILE")
    p_validate.set_defaults(func=cmd_validate)

    p_convert = sub.add_parser(
        "convert",
        help="convert a Kubeflow PyTorchJob manifest into a DistTrainJob",
        description="Convert Kubeflow PyTorchJob manifests (kubeflow.org/v1) into "
        "DistTrainJobs. The training contract, which a PyTorchJob lacks, comes from the "
        "flags; without them the command lists what is missing and exits 2.",
    )
    p_convert.add_argument("file", metavar="FILE")
    contract = p_convert.add_argument_group("training contract")
    contract.add_argument("--global-batch-size", type=int, metavar="N")
    contract.add_argument("--micro-batch-size", type=int, metavar="N")
    contract.add_argument("--lr", type=float, metavar="X", help="learning rate at the global batch size")
    contract.add_argument("--max-steps", type=int, metavar="N")
    contract.add_argument("--max-samples", type=int, metavar="N")
    contract.add_argument("--batch-policy", choices=["fixed", "scaled"])
    contract.add_argument("--lr-scaling", choices=["linear", "sqrt", "none"])
    contract.add_argument("--seed", type=int)
    storage = p_convert.add_argument_group("checkpoints")
    storage.add_argument("--checkpoint-claim", metavar="PVC", help="ReadWriteMany PersistentVolumeClaim")
    storage.add_argument("--checkpoint-volume", metavar="NAME", help="a volume of the pod template")
    storage.add_argument("--checkpoint-path", metavar="PATH")
    storage.add_argument("--checkpoint-interval-steps", type=int, metavar="N")
    p_convert.set_defaults(func=cmd_convert)

    sub.add_parser(  # parsed by the exporter itself (cmd_export); listed here for `disttrain --help`
        "export",
        help="write a checkpoint's model weights, unsharded, as safetensors (needs disttrain[trainer,export]; "
        "`disttrain export --help`)",
        add_help=False,
    )

    from disttrain.operator.leaderlease import ElectionTiming  # pure: no kubernetes import

    defaults = ElectionTiming()
    p_operator = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    scope = p_operator.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        metavar="NS",
        help="watch this namespace (repeatable; kopf globs such as 'team-*' work)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster")
    p_operator.add_argument(
        "--metrics-port", type=int, default=9090, help="serve Prometheus /metrics on this port (0: off; default 9090)"
    )
    p_operator.add_argument("--metrics-address", default="0.0.0.0")
    p_operator.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="kopf liveness endpoint ('' turns it off; default %(default)s)",
    )
    p_operator.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster, else $KUBECONFIG or ~/.kube/config)"
    )
    p_operator.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p_operator.add_argument(
        "--agent-image",
        default="",
        metavar="IMAGE",
        help="image of every job agent pod, a disttrain trainer image (default: ghcr.io/disttrain/trainer at this "
        "operator's version); never the user's template image",
    )
    p_operator.add_argument(
        "--agent-heartbeat-seconds",
        type=_non_negative_seconds,
        default=None,
        metavar="SECONDS",
        help="how often every job agent renews its Lease, so that the loss of its node is noticed in three periods "
        "rather than at NotReady; one small API write per job per period (0: no Lease; default: none while the "
        f"agents pulse, else {constants.AGENT_LEASE_RENEW_SECONDS:g})",
    )
    p_operator.add_argument(
        "--agent-pulse-seconds",
        type=_non_negative_seconds,
        default=constants.AGENT_PULSE_SECONDS,
        metavar="SECONDS",
        help="how often every job agent pulses on a TCP connection this operator holds to its pod, so that the loss "
        f"of its node is noticed {constants.AGENT_PULSE_SILENT_SECONDS:g} s after its last pulse; no API write "
        "(0: no pulse, the Lease alone; default %(default)s)",
    )
    p_operator.add_argument(
        "--agent-pulse-key-file",
        default="",
        metavar="FILE",
        help="a file holding this operator's pulse key (64 hex digits or more; the chart mounts one from its Secret): "
        "each job's pulse key is derived from it, so every replica and every later start of the operator can link "
        "to the agents' pulses (default: a key of this process's own; after a restart the existing agents are then "
        "judged by their Lease)",
    )
    p_operator.add_argument(
        "--network-policy",
        choices=["on", "off"],
        default="on",
        help="create every job's NetworkPolicies (the agent's store port and the workers' ports; default on)",
    )
    p_operator.add_argument(
        "--metrics-scraper-namespace-selector",
        default="{}",
        metavar="JSON",
        help="LabelSelector of the namespaces whose scraper may reach the workers' metrics ports "
        "(default %(default)s: every namespace)",
    )
    p_operator.add_argument(
        "--metrics-scraper-pod-selector",
        default='{"matchLabels": {"app.kubernetes.io/name": "prometheus"}}',
        metavar="JSON",
        help="LabelSelector of the scraper's pods (default %(default)s: prometheus-operator's Prometheus)",
    )
    p_operator.add_argument(
        "--operator-namespace",
        default="",
        metavar="NAMESPACE",
        help="this operator's namespace: the agents' NetworkPolicies admit its pods to their pulse port "
        "(default: none admitted)",
    )
    p_operator.add_argument(
        "--operator-pod-selector",
        default="{}",
        metavar="JSON",
        help="LabelSelector of this operator's pods in --operator-namespace (default %(default)s: every pod there)",
    )
    leading = p_operator.add_argument_group(
        "leader election", "replicas elect one acting operator on a Lease; the others wait as standbys"
    )
    leading.add_argument(
        "--leader-election-lease",
        default="",
        metavar="NAME",
        help="the Lease's name (default: no election, this process acts alone)",
    )
    leading.add_argument(
        "--leader-election-namespace",
        default="",
        metavar="NAMESPACE",
        help="the Lease's namespace (default: --operator-namespace)",
    )
    leading.add_argument(
        "--leader-election-identity",
        default="",
        metavar="ID",
        help="this replica's name in the Lease (default: the host name, a pod's name)",
    )
    leading.add_argument(
        "--leader-election-lease-seconds",
        type=_non_negative_seconds,
        default=defaults.lease_s,
        metavar="SECONDS",
        help="a standby takes the Lease this long after the last renewal it saw (default %(default)s)",
    )
    leading.add_argument(
        "--leader-election-renew-deadline-seconds",
        type=_non_negative_seconds,
        default=defaults.renew_deadline_s,
        metavar="SECONDS",
        help="the leader stops acting (exits) this long after its last successful renewal; less than the lease "
        "(default %(default)s)",
    )
    leading.add_argument(
        "--leader-election-retry-seconds",
        type=_non_negative_seconds,
        default=defaults.retry_s,
        metavar="SECONDS",
        help="how often the leader renews and a standby looks (default %(default)s)",
    )
    p_operator.set_defaults(func=cmd_operator)

    from disttrain.operator.local import cli as local_cli  # light: argparse wiring only

    local_cli.add_parser(sub)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:
        return cmd_export(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
