"""`stallfree router`: an OpenAI-compatible proxy that sends each request to the replica that will serve it soonest.

Replicas come from --replicas (outside a cluster) or from a Service's EndpointSlices (--service, in a
cluster). The admin token that reads their /admin/stats and /admin/profile comes from
--admin-token-file or STALLFREE_ADMIN_TOKEN, as for the daemons.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from stallfree.http_doors.flags import add_door_flags
from stallfree.operator.router.pick import POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree router", description=__doc__.splitlines()[0])
    src = p.add_argument_group("replicas")
    src.add_argument("--replicas", help="comma-separated base URLs, e.g. http://127.0.0.1:8001,http://127.0.0.1:8002")
    src.add_argument("--service", help="in a cluster: the daemons' Service, whose EndpointSlices list the replicas")
    src.add_argument("--namespace", help="the Service's namespace (default: the pod's own)")
    src.add_argument("--port-name", default="http", help="EndpointSlice port name of the daemons' HTTP port")
    src.add_argument("--admin-token-file", help="file holding the daemons' admin token (else env STALLFREE_ADMIN_TOKEN)")
    who = p.add_argument_group("who a request is (tenants and objectives from credentials)")
    who.add_argument("--api-keys-file", default=None,
                     help='JSON {"keys": [{"sha256", "tenant", "objectives"}]}: requests need one of these keys '
                          "(Authorization: Bearer); read again when it changes. Without it: anonymous, one tenant")
    who.add_argument("--trusted-upstream-secret-file", default=None,
                     help="file holding the secret a trusted gateway sends in x-stallfree-upstream-secret: only "
                          "its requests' tenant header (x-gateway-inference-fairness-id) is believed")
    pol = p.add_argument_group("routing")
    pol.add_argument("--policy", choices=POLICIES, default="slo-aware")
    pol.add_argument("--chars-per-token", type=float, default=4.0,
                     help="prompt characters per token, to estimate prompt length (4 for English BPE, 1 for sim)")
    pol.add_argument("--affinity-block-tokens", type=int, default=64, help="prefix affinity hashes blocks of this size")
    pol.add_argument("--affinity-margin-ms", type=float, default=50.0,
                     help="a cache-warm replica wins while its predicted TTFT is within this (or 25%%) of the best")
    pol.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    fc = p.add_argument_group("flow control (requests wait in the router's queue, not on a replica)")
    fc.add_argument("--queue-wait-slo-ms", type=float, default=None,
                    help="the service's p99 queue-wait SLO: a request is dispatched once a replica's queued prefill "
                         "drains within 25%% of it (default without it: 500 ms)")
    fc.add_argument("--objectives", default=None,
                    help="the service's objectives as JSON: [{name, priority, ttftP99Ms, tpotP99Ms, queueWaitP99Ms, "
                         "default}] (the operator renders it from spec.objectives); a request names one in "
                         "x-stallfree-objective. Default: one objective, first come first served")
    fc.add_argument("--no-flow-control", action="store_true",
                    help="send every request to a replica at once (no router queue; for comparisons)")
    fc.add_argument("--max-queued", type=int, default=1024, help="requests waiting at most; more are answered 429")
    fc.add_argument("--queue-timeout-s", type=float, default=60.0,
                    help="a request still queued after this long is answered 503")
    hl = p.add_argument_group("health")
    hl.add_argument("--poll-interval-s", type=float, default=0.25, help="how often each replica's /ready and stats are read")
    hl.add_argument("--health-timeout-s", type=float, default=0.5, help="a replica slower than this is unhealthy")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="0.0.0.0")
    h.add_argument("--port", type=int, default=8080)
    h.add_argument("--probe-port", type=int, default=0,
                   help="also serve /health and /ready on this port, with no connection cap (0: off); point the "
                        "liveness and startup probes at it")
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    d = p.add_argument_group("doors (as the daemon's: `stallfree serve --help`)")
    add_door_flags(d)
    d.add_argument("--idle-timeout-s", type=float, default=5.0, help="an idle keep-alive connection closes after this")
    d.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM: how long requests in flight may finish before their streams are ended")
    d.add_argument("--stream-stall-timeout-s", type=float, default=30.0,
                   help="a stream whose replica sends nothing for this long ends with an error event")
    return p


def replica_urls(spec: str) -> dict[str, str]:
    urls = [u.strip().rstrip("/") for u in spec.split(",") if u.strip()]
    if not urls:
        raise ValueError("--replicas lists no URL")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--replicas: {url!r} is not an http(s) URL")
    if len(set(urls)) != len(urls):
        raise ValueError("--replicas lists a URL twice")
    return {url.split("://", 1)[1]: url for url in urls}


async def serve(args: argparse.Namespace, admin_token: str | None) -> None:
    import uvicorn

    from stallfree.http_doors.connections import limited_h11_protocol
    from stallfree.node_daemon.server.auth import load_secret
    from stallfree.operator.router.api_keys import KeyBook
    from stallfree.operator.router.discovery import EndpointSliceDiscovery
    from stallfree.operator.router.drain import DrainingServer
    from stallfree.operator.router.edge import Doors, create_app
    from stallfree.operator.router.flow_control import FlowConfig, dispatch_wait_ms
    from stallfree.operator.router.objectives import Objectives, parse_objectives
    from stallfree.operator.router.pick import AffinityMargin
    from stallfree.operator.router.probes import probe_server
    from stallfree.operator.router.proxy import Router, RouterConfig
    from stallfree.operator.router.replicas import ReplicaPool

    pool = ReplicaPool(admin_token, poll_interval_s=args.poll_interval_s, timeout_s=args.health_timeout_s)
    config = RouterConfig(policy=args.policy, chars_per_token=args.chars_per_token,
                          block_tokens=args.affinity_block_tokens,
                          margin=AffinityMargin(absolute_ms=args.affinity_margin_ms), seed=args.seed,
                          flow=FlowConfig(dispatch_wait_ms(args.queue_wait_slo_ms), args.max_queued),
                          queue_timeout_s=args.queue_timeout_s, flow_control=not args.no_flow_control,
                          stream_stall_timeout_s=args.stream_stall_timeout_s,
                          objectives=parse_objectives(args.objectives) if args.objectives else Objectives.implicit(),
                          api_keys=KeyBook(args.api_keys_file) if args.api_keys_file else None,
                          upstream_secret=load_secret(args.trusted_upstream_secret_file, "")
                          if args.trusted_upstream_secret_file else None)
    router = Router(pool, config)
    await router.start()
    tasks = []
    if args.replicas:
        pool.set_replicas(replica_urls(args.replicas))
    else:
        discovery = EndpointSliceDiscovery(args.service, args.namespace, pool.set_replicas, port_name=args.port_name)
        tasks.append(asyncio.create_task(discovery.run()))
    app = create_app(router, Doors(max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s))
    protocol = limited_h11_protocol(args.header_timeout_s, args.max_connections,
                                    lambda reason: router.metrics.refused.labels(reason).inc())
    # The drain has ended every stream before uvicorn's own shutdown starts: its grace is only for stragglers.
    # proxy_headers off: the router is the public door, so a client's X-Forwarded-For is no client address.
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, http=protocol, proxy_headers=False,
                                           timeout_keep_alive=args.idle_timeout_s, log_level=args.log_level,
                                           access_log=False, lifespan="off", timeout_graceful_shutdown=3),
                            router, args.drain_timeout_s,
                            companions=[probe_server(router, args.host, args.probe_port, args.log_level)]
                            if args.probe_port else [])
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
        await router.close()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from stallfree.node_daemon.server.auth import ADMIN_TOKEN_ENV, load_secret

    try:
        if bool(args.replicas) == bool(args.service):
            raise ValueError("pass exactly one of --replicas (URLs) or --service (EndpointSlices in a cluster)")
        if args.replicas:
            replica_urls(args.replicas)
        for flag in ("chars_per_token", "poll_interval_s", "health_timeout_s", "queue_timeout_s", "max_queued",
                     "max_body_bytes", "header_timeout_s", "body_timeout_s", "idle_timeout_s", "max_connections",
                     "drain_timeout_s", "stream_stall_timeout_s"):
            if not getattr(args, flag) > 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be positive")
        if args.queue_wait_slo_ms is not None and not args.queue_wait_slo_ms > 0:
            raise ValueError("--queue-wait-slo-ms must be positive")
        if args.affinity_block_tokens < 1 or args.affinity_margin_ms < 0:
            raise ValueError("--affinity-block-tokens must be positive and --affinity-margin-ms >= 0")
        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be 1..65535, got {args.port}")
        if not 0 <= args.probe_port < 65536 or args.probe_port == args.port:
            raise ValueError(f"--probe-port must be 0 (off) or a port other than --port, got {args.probe_port}")
        if args.objectives is not None:
            from stallfree.operator.router.objectives import parse_objectives

            parse_objectives(args.objectives)
        admin_token = load_secret(args.admin_token_file, ADMIN_TOKEN_ENV)
        if args.api_keys_file:
            from stallfree.operator.router.api_keys import KeyBook

            KeyBook(args.api_keys_file)  # a file that does not read stops the router here, with its reason
        if args.trusted_upstream_secret_file:
            load_secret(args.trusted_upstream_secret_file, "")
    except ValueError as exc:
        print(f"stallfree router: error: {exc}", file=sys.stderr)
        return 2
    import prometheus_client

    prometheus_client.disable_created_metrics()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll would drown the log
    try:
        asyncio.run(serve(args, admin_token))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
