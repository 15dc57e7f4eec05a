# Consul client agent configuration for nodes that run leasehold executors.
# Merge with your usual agent settings (datacenter, retry_join, TLS, ACLs).

# check_update_interval: keep Consul's default (5m). Heartbeats carry the
# executor's load in the check output, but an update that changes only the
# output is synced to the servers at most that often, and nothing routes on
# it: status changes (passing <-> warning <-> critical: free, full, lapsed) are
# always synced at once, and the current load goes to dispatchers over ORCA.
# A shorter interval would cost a write and a wake-up of every blocking query
# on the service per heartbeat.

# Executors talk to their local agent only.
client_addr = "127.0.0.1"

# Local services and check state survive an agent restart, so a restart
# shorter than the lease does not end executor sessions.
data_dir = "/opt/consul"
