# ACL policy for `leasehold serve` (read only). leasehold reads the catalog
# (services, their checks and nodes) and the session generation keys in KV
# with blocking queries, and writes nothing.
#   consul acl policy create -name leasehold -rules @examples/consul/leasehold-policy.hcl
#   consul acl token create -policy-name leasehold   # → CONSUL_HTTP_TOKEN for leasehold serve
service_prefix "" {
  policy = "read"
}
node_prefix "" {
  policy = "read"
}
# Session generations: every replica orders sessions from these keys, so a
# session whose newer successor deregistered stays STALE after a restart.
key_prefix "leasehold/generation/" {
  policy = "read"
}
