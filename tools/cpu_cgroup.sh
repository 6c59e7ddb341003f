# Sourced by tools/test.sh: CPU seconds per phase, from a cgroup-v1 cpuacct group of its own
# (root on these VMs). Every process a phase starts (Ray's raylets and workers, kube-apiserver,
# torch ranks) inherits the group, so the two lanes are counted apart. Where the hierarchy is
# not writable, every figure is "-" and nothing else changes.
CG_BASE=/sys/fs/cgroup/cpuacct
CG_ROOT=""
cg_init() {  # WORK_NAME: one parent group for this run
  [[ -w "$CG_BASE" ]] || return 0
  CG_ROOT="$CG_BASE/tg-test.$1"
  mkdir -p "$CG_ROOT" 2>/dev/null || CG_ROOT=""
}
# cg_enter NAME: move this (sub)shell into the group NAME (made here); call it in a subshell.
cg_enter() {
  [[ -n "$CG_ROOT" ]] && mkdir -p "$CG_ROOT/$1" 2>/dev/null \
    && echo "$BASHPID" > "$CG_ROOT/$1/cgroup.procs" 2>/dev/null
  return 0
}
# cg_run NAME CMD...: run the command CMD with its process tree in the group NAME.
cg_run() { local name="$1"; shift; ( cg_enter "$name"; exec "$@" ); }
cg_usage_file() { [[ -n "$CG_ROOT" ]] && echo "$CG_ROOT/$1/cpuacct.usage"; }
cg_seconds() {  # NAME: CPU seconds used so far by the group's processes, or -
  local f; f="$(cg_usage_file "$1")"
  if [[ -n "$f" && -r "$f" ]]; then echo $(( $(cat "$f") / 1000000000 )); else echo -; fi
}
# The machine's busy CPU seconds since boot (user+nice+system+irq+softirq+steal), and Docker's
# containers' (kind nodes, image builds), to put the phases beside the whole.
machine_cpu_seconds() {
  awk '/^cpu /{printf "%d\n", ($2+$3+$4+$7+$8+$9)/100}' /proc/stat
}
docker_cpu_seconds() {
  local f="$CG_BASE/docker/cpuacct.usage"
  if [[ -r "$f" ]]; then echo $(( $(cat "$f") / 1000000000 )); else echo 0; fi
}
# Empty groups are removed at exit (their processes have ended; a leftover keeps its group).
cg_cleanup() {
  [[ -n "$CG_ROOT" ]] || return 0
  local d
  for d in "$CG_ROOT"/*/; do rmdir "$d" 2>/dev/null || true; done
  rmdir "$CG_ROOT" 2>/dev/null || true
}
