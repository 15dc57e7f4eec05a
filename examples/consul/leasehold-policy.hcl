# ACL policy for `leasehold serve`. leasehold reads the catalog and a few KV
# prefixes with blocking queries, and writes only its lapse marks. Consul
# 1.13 leaves out, without an error, what a token may not read; leasehold
# notices (the X-Consul-Results-Filtered-By-ACLs header, and a read of each
# prefix that may be empty) and stays unready (/readyz 503, reason "acl")
# naming the rule below that is missing, instead of serving as if there were
# no executors, generations or cordons.
#   consul acl policy create -name leasehold -rules @examples/consul/leasehold-policy.hcl
#   consul acl token create -policy-name leasehold   # → CONSUL_HTTP_TOKEN for leasehold serve

# The task types and their executors: /v1/catalog/services, the members of
# each task type (/v1/catalog/service/<task>, /v1/health/service/<task>)
# with their service checks. Read on every service, since task types are
# whatever services carry the tag, and the lapse marks' pruner looks for
# their sessions in every service; the servers' own "consul" service is how
# leasehold tells an empty catalog from an unreadable one.
service_prefix "" {
  policy = "read"
}
# Node checks (serfHealth: a node that failed; maintenance) and the nodes
# the executors run on: the non-passing checks (/v1/health/state/critical
# and warning), every node's serfHealth, and the members' node checks.
node_prefix "" {
  policy = "read"
}
# Session generations: every replica orders sessions from these keys, so a
# session whose newer successor deregistered stays STALE after a restart.
key_prefix "leasehold/generation/" {
  policy = "read"
}
# The operators' controls: rollout rules (leasehold/control/rules) and
# cordons (leasehold/control/cordons/<id>), watched by every replica. Without
# it every cordon and rule would be ignored.
key_prefix "leasehold/control/" {
  policy = "read"
}
# Lapse marks: each lapse a replica sees is written here (once, create-only;
# kept while the session is registered anywhere, removed 73 h after its last
# registration went, the time counted in the mark) and every replica reads
# them, so a lapsed session is never routed again, also after a restart.
key_prefix "leasehold/lapsed/" {
  policy = "write"
}
