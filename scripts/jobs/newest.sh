# Sourced by the job scripts: `newest_numbered GLOB...` prints the path whose trailing `_<number>` is largest
# (drafters/<run>/loss_tokens_<N>, checkpoints/step_<N>), or nothing. `ls | sort` orders 10000000 before 4000000
# and `sort -t_ -k<field>` keys on a field whose place depends on the path's own underscores.
newest_numbered() {
  ls -d "$@" 2>/dev/null | awk -F_ '{print $NF, $0}' | sort -n | tail -1 | cut -d' ' -f2- || true  # none: prints nothing
}
