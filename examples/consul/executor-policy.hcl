# ACL policy for one executor instance "exec-1" serving task type "work":
# registration is authenticated by Consul ACLs — this token may register,
# heartbeat and deregister the service "work" only, and take the session
# generation of its own instance id. Make one policy per instance (or per
# fleet, with service "work" and key_prefix "leasehold/generation/").
#   consul acl policy create -name exec-1 -rules @examples/consul/executor-policy.hcl
#   consul acl token create -policy-name exec-1      # → CONSUL_HTTP_TOKEN for the executor
service "work" {
  policy = "write"
}
# The Registrar checks the catalog once per lease for a newer session of its
# instance registered through another agent.
service_prefix "" {
  policy = "read"
}
node_prefix "" {
  policy = "read"
}
key "leasehold/generation/exec-1" {
  policy = "write"
}
