# Consul client agent configuration for nodes that run leasehold executors.
# Merge with your usual agent settings (datacenter, retry_join, TLS, ACLs).

# Heartbeats carry the executor's load in the check output. An update that
# changes only the output is synced to the servers at most this often; status
# changes (passing <-> warning <-> critical: free, full, lapsed) are always
# synced at once. Every synced update wakes every blocking query on the
# service, so syncing each 10 s heartbeat of a large fleet is wasted work.
# 30 s keeps the load leasehold shows at most 30 s old.
check_update_interval = "30s"

# Executors talk to their local agent only.
client_addr = "127.0.0.1"

# Local services and check state survive an agent restart, so a restart
# shorter than the lease does not end executor sessions.
data_dir = "/opt/consul"
