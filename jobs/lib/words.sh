# shellcheck shell=bash
# Every job script sources this before its first array: an empty array under `set -u` is an
# unbound variable to bash before 4.4 (RHEL/CentOS 7's 4.2), which would end a job midway.
if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404 )); then
    echo "error: bash $BASH_VERSION runs this job script; the job scripts need bash 4.4 or" \
         "newer (RHEL 8 and Ubuntu 18.04 have it): load a newer bash and run them with it" >&2
    exit 2
fi
# Sourced by the PBS job scripts, whose arguments come from the environment (PBS passes a
# script none): `words VAR` sets the array WORDS to VAR's words as a command line splits them:
# quotes group ('placement.per_node={simulator: 4, learner: 2}' is one word), blanks and
# newlines separate, nothing is expanded (xargs's rules). Unclosed quotes end the job, named.
words() {
    local text=${!1:-} parsed
    if ! parsed=$(printf '%s' "$text" | xargs -r printf '%s\n'); then
        echo "error: $1=$text: its quotes do not close (quote a value that holds blanks as" \
             "on a command line: '...')" >&2
        exit 2
    fi
    WORDS=()
    if [[ -n $parsed ]]; then
        mapfile -t WORDS <<< "$parsed"
    fi
}
