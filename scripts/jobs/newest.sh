# Sourced by the job scripts: `by_number GLOB...` prints the paths in the order of their trailing `_<number>`
# (drafters/<run>/loss_tokens_<N>, checkpoints/step_<N>), `newest_numbered GLOB...` the last of them, or nothing.
# `ls | sort` orders 10000000 before 4000000 and `sort -t_ -k<field>` keys on a field whose place depends on the
# path's own underscores.
by_number() {
  ls -d "$@" 2>/dev/null | awk -F_ '{print $NF, $0}' | sort -n | cut -d' ' -f2- || true  # none: prints nothing
}
newest_numbered() {
  by_number "$@" | tail -1
}
