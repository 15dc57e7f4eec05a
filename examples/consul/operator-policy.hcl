# ACL policy for the operators' commands: `leasehold cordon`, `uncordon`,
# `approve`, `rules set|show|clear` and `audit`. They work in Consul KV only
# (check-and-set transactions), and never touch the catalog. Give each
# operator a token of their own: with ACLs on, the audit trail records the
# token's description and accessor id as who acted (--by is ignored), and a
# cordon's approver must be another token than its author.
#   consul acl policy create -name leasehold-operator -rules @examples/consul/operator-policy.hcl
#   consul acl token create -policy-name leasehold-operator -description "alice"   # → CONSUL_HTTP_TOKEN for alice

# Cordons (leasehold/control/cordons/<id>: create, approve, remove, list)
# and the rollout rules (leasehold/control/rules: set, show, clear).
key_prefix "leasehold/control/" {
  policy = "write"
}
# The audit trail: every change writes its record in the same transaction
# (create-only), `leasehold audit` lists it, and the writing command prunes
# records beyond --audit-keep or older than --audit-max-age (delete).
key_prefix "leasehold/audit/" {
  policy = "write"
}
# No rule is needed for the operator's identity: a token may always read
# itself (/v1/acl/token/self), which gives the description shown as the
# actor. A read-only auditor needs only `policy = "read"` on both prefixes
# (`cordon --list`, `rules show`, `audit`).
