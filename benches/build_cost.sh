#!/bin/bash
# Issue 34's build-cost measurements, all in one run on this machine (run it when the machine is
# quiet: other builds running beside it make every number larger).
#
#   benches/build_cost.sh [AFTER_REF] [BEFORE_REF]   defaults: HEAD, 2e1683a
#   ROUNDS=3 benches/build_cost.sh                      cold builds repeated, every round printed
#   PARTS=oneline benches/build_cost.sh                 only part 1 (PARTS=pipeline: only part 2)
#   INCREMENTAL=0 benches/build_cost.sh                 part 1 as a registry dependency builds:
#       cargo compiles path dependencies (these programs' gpu-pool) incrementally, which a crate
#       from crates.io is not (cudarc, here); CARGO_INCREMENTAL=0 builds all alike
#
# 1. A one-line program (`gpu_pool::Device::host()`), built cold (debug, fresh target directory,
#    warm registry, --offline) on gpu-pool with default features at AFTER_REF and at BEFORE_REF,
#    and the same on cudarc alone with the CUDA features gpu-pool's `cuda` turns on, and on cudarc
#    with syn (`full`): the floor of any attribute DSL on cudarc, and on cudarc with gpu-pool's
#    macros (the DSL as if the runtime cost nothing), and on cudarc with an attribute on
#    proc-macro2 and quote alone (the floor of any proc-macro DSL, without a parser). Prints wall
#    and CPU seconds, and the crates of each (`cargo tree -e normal`, the program included).
# 2. The README's first command, `cargo run --release --example pipeline`, in a fresh clone of
#    each ref with a fresh target directory: build and run timed apart, and the units compiled.
#
# Everything happens in one scratch directory, removed at the end.
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
REPO=$(git -C "$HERE" rev-parse --path-format=absolute --git-common-dir)
AFTER=${1:-HEAD}
BEFORE=${2:-2e1683a}
ROUNDS=${ROUNDS:-1}
PARTS=${PARTS:-oneline,pipeline}   # PARTS=oneline or PARTS=pipeline runs one part
S=${TMPDIR:-/tmp}/gpu-pool-build-cost
export CARGO_TERM_COLOR=never
rm -rf "$S"
mkdir -p "$S"
trap 'rm -rf "$S"' EXIT

clone() { # clone REF DIR
  local sha
  sha=$(git -C "$HERE" rev-parse --verify "$1^{commit}") || exit 1
  git clone -q --no-checkout "$REPO" "$2" && git -C "$2" checkout -q --detach "$sha"
  echo "$1 = $(git -C "$2" log -1 --format='%h %s' | cut -c1-70)"
}
clone "$BEFORE" "$S/before"
clone "$AFTER" "$S/after"

# The one-line programs.
oneline() { # oneline NAME DEPENDENCY-LINE LOCKFILE MAIN
  mkdir -p "$S/$1/src"
  printf '[package]\nname = "%s"\nversion = "0.0.0"\nedition = "2024"\npublish = false\n[dependencies]\n%s\n[workspace]\n' "$1" "$2" > "$S/$1/Cargo.toml"
  echo "$4" > "$S/$1/src/main.rs"
  cp "$3" "$S/$1/Cargo.lock"
}
oneline one-before "gpu-pool = { path = \"$S/before\" }" "$S/before/Cargo.lock" 'fn main() { let _ = gpu_pool::Device::host(); }'
oneline one-after "gpu-pool = { path = \"$S/after\" }" "$S/after/Cargo.lock" 'fn main() { let _ = gpu_pool::Device::host(); }'
# What gpu-pool-runtime's `cuda` feature asks of cudarc (the workspace's cudarc line).
CUDARC=$(sed -n 's/^cudarc = \(.*\)/cudarc = \1/p' "$S/after/Cargo.toml")
oneline one-cudarc "$CUDARC" "$S/after/Cargo.lock" 'fn main() { let _ = cudarc::driver::result::init(); }'
echo "cudarc alone: $CUDARC"
# The floor of any attribute DSL on cudarc: cudarc, and the parser such a DSL needs (syn with
# `full`) built as a proc-macro's dependency is (a build dependency: the same profile, no debug
# info), nothing of gpu-pool's own.
oneline one-syn "$CUDARC" "$S/after/Cargo.lock" 'fn main() { let _ = cudarc::driver::result::init(); }'
sed -i 's/^\[workspace\]$/[build-dependencies]\nsyn = { version = "2", features = ["full"] }\n[workspace]/' "$S/one-syn/Cargo.toml"
echo 'fn main() { let _ = syn::parse_str::<syn::Expr>("1"); }' > "$S/one-syn/build.rs"
# The floor of any proc-macro DSL on cudarc, parser or not: cudarc and an attribute that hands its
# input back through proc-macro2 and quote, with no syn.
mkdir -p "$S/pm-tokens/src"
printf '[package]\nname = "pm-tokens"\nversion = "0.0.0"\nedition = "2024"\npublish = false\n[lib]\nproc-macro = true\n[dependencies]\nproc-macro2 = "1"\nquote = "1"\n[workspace]\n' > "$S/pm-tokens/Cargo.toml"
echo 'use proc_macro::TokenStream;
#[proc_macro_attribute]
pub fn same(_: TokenStream, item: TokenStream) -> TokenStream {
    let item = proc_macro2::TokenStream::from(item);
    quote::quote!(#item).into()
}' > "$S/pm-tokens/src/lib.rs"
oneline one-tokens "$CUDARC
pm-tokens = { path = \"$S/pm-tokens\" }" "$S/after/Cargo.lock" '#[pm_tokens::same] fn main() { let _ = cudarc::driver::result::init(); }'
# The floor of gpu-pool's DSL: cudarc and gpu-pool's macros (syn included), as if the runtime cost
# nothing.
oneline one-macros "$CUDARC
gpu-pool-macros = { path = \"$S/after/pool-macros\" }" "$S/after/Cargo.lock" 'fn main() { let _ = cudarc::driver::result::init(); }'


crates() { # distinct packages (name + version) in the normal dependency tree, the program included
  (cd "$S/$1" && cargo tree --offline -e normal --prefix none 2>/dev/null | awk '{print $1, $2}' | sort -u | wc -l)
}

cold() { # cold NAME: a debug build in a fresh target directory
  rm -rf "$S/$1/target"
  (cd "$S/$1" && /usr/bin/time -o "$S/$1.time" -f "%e %U %S" env ${INCREMENTAL:+CARGO_INCREMENTAL=$INCREMENTAL} cargo build --offline -q >/dev/null 2>"$S/$1.err")
  if [ ! -x "$S/$1/target/debug/$1" ]; then echo "$1: build failed:"; cat "$S/$1.err"; return; fi
  read -r wall user sys < "$S/$1.time"
  printf '%-11s wall %6.1f s   cpu %6.1f s   crates %s\n' "$1" "$wall" "$(echo "$user + $sys" | bc)" "$(crates "$1")"
  echo "$ROUND $1 $wall" >> "$S/walls"
  rm -rf "$S/$1/target"
}

if [[ $PARTS == *oneline* ]]; then
echo
echo "== one-line program, cold debug build ($(nproc) cores${INCREMENTAL:+, CARGO_INCREMENTAL=$INCREMENTAL})"
for r in $(seq "$ROUNDS"); do
  [ "$ROUNDS" -gt 1 ] && echo "-- round $r"
  for v in one-cudarc one-tokens one-syn one-macros one-after one-before; do ROUND=$r cold "$v"; done
done
# Each round's walls against that round's cudarc alone (the machine's speed drifts between
# rounds, so a ratio within a round is the fair one), and the median of each over the rounds.
echo "-- wall ratio to cudarc alone, by round, and the median"
python3 - "$S/walls" <<'PY'
import statistics, sys
walls = {}
for line in open(sys.argv[1]):
    r, name, wall = line.split()
    walls.setdefault(name, {})[r] = float(wall)
base = walls.get("one-cudarc", {})
for name in ("one-tokens", "one-syn", "one-macros", "one-after", "one-before"):
    ratios = [w / base[r] for r, w in walls.get(name, {}).items() if r in base]
    if ratios:
        print(f"{name:11s} " + " ".join(f"{x:.2f}" for x in ratios) + f"   median {statistics.median(ratios):.2f}x"
              f"   (median walls {statistics.median(walls[name].values()):.1f} s against {statistics.median(base.values()):.1f} s)")
PY
fi

if [[ $PARTS == *pipeline* ]]; then
echo
echo "== cargo run --release --example pipeline, fresh clone, fresh target"
for v in before after; do
  cd "$S/$v" || exit 1
  rm -rf target
  start=$(date +%s.%N)
  units=$(cargo build --release --offline --example pipeline 2>&1 | tee "$S/$v.build.log" | grep -c '^ *Compiling')
  built=$(date +%s.%N)
  if [ ! -x target/release/examples/pipeline ]; then echo "$v: build failed"; tail -20 "$S/$v.build.log"; continue; fi
  target/release/examples/pipeline >/dev/null 2>&1
  ran=$(date +%s.%N)
  printf '%-7s build %6.1f s (%s units compiled)   run %5.1f s   total %6.1f s\n' "$v" \
    "$(echo "$built - $start" | bc)" "$units" "$(echo "$ran - $built" | bc)" "$(echo "$ran - $start" | bc)"
  rm -rf target
done
fi
