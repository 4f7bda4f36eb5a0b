# Source (bash) to load this machine's site preset. Used by site/common.sh inside jobs and
# by sbatch_site.sh before submitting; sourcing it in a login shell is equivalent to
# sourcing the chosen preset directly. The preset is, first match wins:
#   1. site/$SITE.sh             when SITE is set (every preset exports SITE=<its name>,
#                                so a preset sourced before `sbatch` is the one the job uses)
#   2. site/local.sh             when it exists (a site's own copy of generic.sh)
#   3. site/perlmutter.sh        when NERSC_HOST=perlmutter
#   4. site/generic.sh           otherwise

_site_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${SITE:-}" ]; then
    _site_file="$_site_dir/$SITE.sh"
elif [ -f "$_site_dir/local.sh" ]; then
    _site_file="$_site_dir/local.sh"
elif [ "${NERSC_HOST:-}" = perlmutter ]; then
    _site_file="$_site_dir/perlmutter.sh"
else
    _site_file="$_site_dir/generic.sh"
fi
if [ ! -f "$_site_file" ]; then
    echo "site/load.sh: no preset $_site_file (SITE=${SITE:-}); presets:" \
        "$(cd "$_site_dir" && ls -- *.sh | grep -v -e '^load.sh$' -e '^common.sh$' -e '^task.sh$' | sed 's/\.sh$//' | tr '\n' ' ')" >&2
    unset _site_dir _site_file
    return 1 2>/dev/null || exit 1
fi
# shellcheck source=/dev/null
source "$_site_file"
unset _site_dir _site_file
