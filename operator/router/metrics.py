"""The router's Prometheus metrics (stallfree_router_*), in its own registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# TTFT buckets fine enough for SLOs of tens of milliseconds up to queues of tens of seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self) -> None:
        reg = self.registry = CollectorRegistry()
        self.picks = Counter("stallfree_router_picks", "Requests sent, by replica, policy and why that replica.",
                             ["replica", "policy", "reason"], registry=reg)
        self.predicted_ttft = Histogram("stallfree_router_predicted_ttft_seconds",
                                        "TTFT the policy predicted for the replica it picked.", ["policy"],
                                        buckets=TTFT_BUCKETS, registry=reg)
        self.observed_ttft = Histogram("stallfree_router_observed_ttft_seconds",
                                       "Request received to the upstream's first body byte.", ["policy"],
                                       buckets=TTFT_BUCKETS, registry=reg)
        self.ttft_error = Histogram("stallfree_router_ttft_prediction_error_seconds",
                                    "|observed - predicted| TTFT of slo-aware picks.", ["policy"],
                                    buckets=TTFT_BUCKETS, registry=reg)
        self.retries = Counter("stallfree_router_retries", "Requests re-sent to another replica before any byte "
                               "reached the client, by why.", ["reason"], registry=reg)
        self.stream_errors = Counter("stallfree_router_stream_errors",
                                     "Streams that failed after their first byte (ended with an error event).",
                                     ["replica"], registry=reg)
        self.unroutable = Counter("stallfree_router_unroutable", "Requests refused: no ready replica.", registry=reg)
        self.replicas_healthy = Gauge("stallfree_router_replicas_healthy", "Replicas taking requests.", registry=reg)
        self.replicas_known = Gauge("stallfree_router_replicas", "Replicas known (healthy or not).", registry=reg)
        self.replica_healthy = Gauge("stallfree_router_replica_healthy", "1 while the replica takes requests.",
                                     ["replica"], registry=reg)
        # Flow control (flow_control.py): requests wait here, not on a replica.
        self.queue_depth = Gauge("stallfree_router_queue_depth", "Requests waiting in the router's queue.",
                                 registry=reg)
        self.queue_prompt_tokens = Gauge("stallfree_router_queue_prompt_tokens",
                                         "Estimated prompt tokens of the requests waiting in the router's queue.",
                                         registry=reg)
        self.queue_wait = Histogram("stallfree_router_queue_wait_seconds",
                                    "Router arrival to dispatch to a replica.", buckets=TTFT_BUCKETS, registry=reg)
        self.arrivals = Counter("stallfree_router_arrivals", "Requests that reached the router's queue.",
                                registry=reg)
        self.queue_rejected = Counter("stallfree_router_queue_rejected",
                                      "Requests refused with 429: the router's queue was full.", registry=reg)
        self.queue_cancelled = Counter("stallfree_router_queue_cancelled",
                                       "Requests whose client left while they waited in the router's queue.",
                                       registry=reg)
        self.queue_timeouts = Counter("stallfree_router_queue_timeouts",
                                      "Requests that waited past the queue timeout (503).", registry=reg)
        # The doors (edge.py, admission.py): what the router answered itself, before any replica saw it.
        self.refused = Counter("stallfree_router_refused", "Requests the router refused itself (body too large or "
                               "too slow, bad JSON, unknown path or model, too many connections), by why.",
                               ["reason"], registry=reg)
        self.client_left = Counter("stallfree_router_client_left", "Requests whose client left after they were "
                                   "read (aborted upstream), by when: before_answer or streaming.", ["stage"],
                                   registry=reg)
        self.in_flight = Gauge("stallfree_router_requests_in_flight", "Requests the router has open.", registry=reg)
        # Objectives (objectives.py): the same queue, seen per class of request.
        self.objective_queue_depth = Gauge("stallfree_router_objective_queue_depth",
                                           "Requests waiting in the router's queue, by objective.", ["objective"],
                                           registry=reg)
        self.objective_queue_wait = Histogram("stallfree_router_objective_queue_wait_seconds",
                                              "Router arrival to dispatch to a replica, by objective.", ["objective"],
                                              buckets=TTFT_BUCKETS, registry=reg)
        self.objective_requests = Counter(
            "stallfree_router_objective_requests", "Requests that named an objective, by how their wait in the "
            "router ended: dispatched, shed (refused at arrival, predicted to miss), queue_full, timeout, "
            "no_replica, cancelled.", ["objective", "outcome"], registry=reg)
        self.objective_ttft = Histogram("stallfree_router_objective_observed_ttft_seconds",
                                        "Request received to the upstream's first body byte, by objective.",
                                        ["objective"], buckets=TTFT_BUCKETS, registry=reg)
        self.objective_ttft_missed = Counter("stallfree_router_objective_ttft_missed",
                                             "Requests whose first byte came after their objective's TTFT target.",
                                             ["objective"], registry=reg)
