# ACL policy for one executor instance "exec-1" serving task type "work":
# this token may register, heartbeat and deregister the service "work" only,
# and take the session generation of its own instance id — and no other's.
# Consul's ACLs restrict service names, not service ids or meta, so any token
# of this policy may register any instance id of "work"; the generation key
# is what leasehold trusts on which session of an instance is newest, and
# only this instance may write its own. Make one policy per instance (replace
# exec-1 with its id; docs/contract.md, "The key is the authority"): a fleet-wide
# key_prefix "leasehold/generation/" write would let any executor fence
# another.
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
# Before registering a new session the Registrar asks whether Consul holds
# its agent's node failed, which needs the agent's node name (/v1/agent/self).
agent_prefix "" {
  policy = "read"
}
