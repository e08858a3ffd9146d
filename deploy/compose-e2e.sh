#!/usr/bin/env bash
# loomserve on Docker Compose, for real, on a host that reaches package registries and no image
# registry: builds every image from Debian's packages and PyPI, runs
# `docker compose up --scale worker=2 --scale gateway=3`, sends completions through nginx and
# checks that every gateway is connected to every worker and that every replica served some,
# SIGKILLs a worker container and checks that Docker restarts it and that it takes load again.
#
#   sudo bash deploy/compose-e2e.sh            # as root: installs what is missing with apt
#   bash deploy/compose-e2e.sh --keep          # leave the deployment running afterwards
#
# What it needs and installs when missing: Debian's docker.io (and starts dockerd when none
# runs), debootstrap, and Compose v2 with buildx from Debian's next release (trixie), fetched
# with a private apt configuration that leaves the host's sources alone.
# Settings (environment): WORKERS=2 GATEWAYS=3, PROJECT (compose project name), BASE_IMAGE,
# NGINX_IMAGE, IMAGE (tags to build or reuse), PIP_CERT_FILE (CA bundle for pip inside the
# build; default: the host's system bundle), PIP_INDEX_URL, DEBIAN_MIRROR, LOOMSERVE_THREADS
# (default 1 per worker), and any LOOMSERVE_* setting compose.yaml passes through.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

WORKERS=${WORKERS:-2}
GATEWAYS=${GATEWAYS:-3}
PROJECT=${PROJECT:-loomserve-e2e}
SUITE=bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_IMAGE=${BASE_IMAGE:-loomserve-base:${SUITE}}
export NGINX_IMAGE=${NGINX_IMAGE:-loomserve-nginx:${SUITE}}
export IMAGE=${IMAGE:-loomserve:e2e}
export BUILDER_IMAGE=${BASE_IMAGE} BASE_IMAGE
# Two workers share the host's cores; one thread each keeps them from fighting over them.
export LOOMSERVE_THREADS=${LOOMSERVE_THREADS:-1}
if [ -z "${PIP_CERT_FILE:-}" ] && [ -s /etc/ssl/certs/ca-certificates.crt ]; then
    # pip in the build then trusts what this host trusts, an intercepting proxy's CA included.
    export PIP_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi

KEEP=0
for arg in "$@"; do
    case "${arg}" in
        --keep) KEEP=1 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: ${arg}" >&2; exit 2 ;;
    esac
done

WORK="$(mktemp -d)"
STARTED_DOCKERD=""
started=${SECONDS}

say() { echo "::: [$((SECONDS - started)) s] $*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
compose() { docker compose -p "${PROJECT}" "$@"; }

cleanup() {
    local status=$?
    if [ "${status}" -ne 0 ] && docker info >/dev/null 2>&1; then
        compose ps -a 2>/dev/null || true
        compose logs --no-color --tail 40 2>/dev/null || true
    fi
    if [ "${KEEP}" -eq 0 ] && docker info >/dev/null 2>&1; then
        compose down --volumes --timeout 10 >/dev/null 2>&1 || true
    fi
    if [ -n "${STARTED_DOCKERD}" ] && [ "${KEEP}" -eq 0 ]; then
        as_root kill -TERM "${STARTED_DOCKERD}" 2>/dev/null || true
    fi
    rm -rf "${WORK}"
    say "done (exit ${status})"
}
trap cleanup EXIT

# --- the tools --------------------------------------------------------------------------------

install_debian_packages() {
    local missing=()
    command -v dockerd >/dev/null || [ -x /usr/sbin/dockerd ] || missing+=(docker.io)
    command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
    if [ "${#missing[@]}" -gt 0 ]; then
        say "apt-get install ${missing[*]}"
        as_root apt-get update -qq
        as_root apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
}

install_compose_v2() {
    # bookworm's docker-compose is Compose v1 and it has no buildx; trixie's are static Go
    # binaries that need only libc, so their packages install as they are.
    local wanted=()
    docker compose version 2>/dev/null | grep -q ' v\?2\.' || wanted+=(docker-compose)
    docker buildx version >/dev/null 2>&1 || wanted+=(docker-buildx)
    [ "${#wanted[@]}" -gt 0 ] || return 0
    say "installing ${wanted[*]} from Debian trixie"
    local apt="${WORK}/apt"
    mkdir -p "${apt}/lists/partial" "${apt}/cache/archives/partial" "${apt}/debs"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${DEBIAN_MIRROR} trixie main" \
        >"${apt}/sources.list"
    local options=(
        -o "Dir::Etc::SourceList=${apt}/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=${apt}/lists" -o "Dir::Cache=${apt}/cache"
        -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
        -o APT::Sandbox::User=root
    )
    as_root apt-get "${options[@]}" update -qq
    (cd "${apt}/debs" && as_root apt-get "${options[@]}" download "${wanted[@]}")
    as_root dpkg -i "${apt}"/debs/*.deb
}

start_dockerd() {
    docker info >/dev/null 2>&1 && return 0
    say "starting dockerd"
    as_root dockerd >"${WORK}/dockerd.log" 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && return 0
        sleep 1
    done
    cat "${WORK}/dockerd.log" >&2
    fail "dockerd did not start"
}

# --- the images -------------------------------------------------------------------------------

build_base_image() {
    if docker image inspect "${BASE_IMAGE}" >/dev/null 2>&1; then
        say "base image ${BASE_IMAGE} already built"
        return
    fi
    say "debootstrap ${SUITE} -> ${BASE_IMAGE}"
    local root="${WORK}/rootfs"
    as_root debootstrap --variant=minbase "${SUITE}" "${root}" "${DEBIAN_MIRROR}" >"${WORK}/debootstrap.log" \
        || { tail -20 "${WORK}/debootstrap.log" >&2; fail "debootstrap"; }
    # What Debian's own images do: no daemons started by package scripts, no apt caches kept.
    printf '#!/bin/sh\nexit 101\n' | as_root tee "${root}/usr/sbin/policy-rc.d" >/dev/null
    as_root chmod 755 "${root}/usr/sbin/policy-rc.d"
    as_root chroot "${root}" apt-get clean
    as_root rm -rf "${root}"/var/lib/apt/lists/* "${root}"/var/cache/apt/*.bin
    as_root tar -C "${root}" -c . | docker import --change 'CMD ["bash"]' - "${BASE_IMAGE}" >/dev/null
    as_root rm -rf "${root}"
}

build_images() {
    say "building ${NGINX_IMAGE}"
    docker build -q -f deploy/nginx.Dockerfile --build-arg "BASE_IMAGE=${BASE_IMAGE}" \
        -t "${NGINX_IMAGE}" deploy >/dev/null
    say "building ${IMAGE} (llama-cpp-python compiles: minutes)"
    local build_started=${SECONDS}
    # One service builds the image both loomserve services run.
    compose build --progress plain worker >"${WORK}/build.log" 2>&1 \
        || { tail -40 "${WORK}/build.log" >&2; fail "docker compose build"; }
    say "built ${IMAGE} in $((SECONDS - build_started)) s"
}

# --- the checks -------------------------------------------------------------------------------

# Send COUNT completions, PARALLEL at a time, through the load balancer; print "ok failed".
send_completions() {
    local count=$1 parallel=$2
    python3 - "http://127.0.0.1:${HTTP_PORT}" "${count}" "${parallel}" <<'EOF'
import concurrent.futures
import json
import sys
import urllib.request

url, count, parallel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def complete(index: int) -> bool:
    body = {"prompt": f"Story {index}: once upon a time", "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return isinstance(json.load(response)["choices"][0]["text"], str)
    except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
        print(f"request {index}: {exc}", file=sys.stderr)
        return False


with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    results = list(pool.map(complete, range(count)))
print(sum(results), len(results) - sum(results))
EOF
}

# Sum of a Prometheus counter that a container serves on its own loopback.
container_counter() {
    local container=$1 url=$2 name=$3
    docker exec "${container}" python3 -c "
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
print(int(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(sys.argv[2]))))
" "${url}" "${name}"
}

worker_gateways() { container_counter "$1" http://127.0.0.1:9100/metrics 'loomserve:gateways_connected'; }
worker_finished() { container_counter "$1" http://127.0.0.1:9100/metrics 'loomserve:requests_finished_total'; }
gateway_finished() { container_counter "$1" http://127.0.0.1:8000/metrics 'loomserve:request_success_total'; }

containers() { compose ps -q "$1" | sort; }
name_of() { docker inspect -f '{{.Name}}' "$1" | sed 's#^/##'; }

# Send batches until every container of SERVICE has served at least one request, at most
# ROUNDS batches; every request must succeed.
until_every_replica_served() {
    local service=$1 rounds=$2 counter=$3
    local round ok failed idle
    for round in $(seq "${rounds}"); do
        read -r ok failed < <(send_completions 12 6)
        [ "${failed}" -eq 0 ] || fail "${failed} of $((ok + failed)) completions failed (round ${round})"
        idle=()
        for c in $(containers "${service}"); do
            [ "$("${counter}" "${c}")" -gt 0 ] || idle+=("$(name_of "${c}")")
        done
        if [ "${#idle[@]}" -eq 0 ]; then
            say "every ${service} replica served completions after $((round * 12)) requests"
            return 0
        fi
    done
    fail "after $((rounds * 12)) completions these ${service} replicas served none: ${idle[*]}"
}

# Every gateway must hold a connection to every worker: each worker counts GATEWAYS of them.
every_gateway_reaches() {
    local worker=$1 seen=""
    for _ in $(seq 60); do
        seen=$(worker_gateways "${worker}")
        # At least: a gateway that reconnected under a new identity counts twice until its old
        # one times out.
        [ "${seen}" -ge "${GATEWAYS}" ] && return 0
        sleep 1
    done
    fail "$(name_of "${worker}") hears from ${seen} of ${GATEWAYS} gateways"
}

report_load() {
    local c
    for c in $(containers worker); do
        echo "    $(name_of "${c}"): $(worker_finished "${c}") requests finished"
    done
    for c in $(containers gateway); do
        echo "    $(name_of "${c}"): $(gateway_finished "${c}") requests answered"
    done
}

wait_healthy() {
    local container=$1 timeout=$2 status=""
    for _ in $(seq "${timeout}"); do
        status=$(docker inspect -f '{{.State.Health.Status}}' "${container}" 2>/dev/null || true)
        [ "${status}" = healthy ] && return 0
        sleep 1
    done
    fail "$(name_of "${container}") not healthy after ${timeout} s (status: ${status})"
}

# --- the run ----------------------------------------------------------------------------------

# One function, read whole before it runs: editing this file mid-run cannot derail the run.
main() {
    local victim restarts ok failed c
    install_debian_packages
    install_compose_v2
    start_dockerd
    build_base_image
    build_images

    HTTP_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    export HTTP_PORT
    say "docker compose up --scale worker=${WORKERS} --scale gateway=${GATEWAYS} (nginx on :${HTTP_PORT})"
    compose up -d --no-build --wait --wait-timeout 600 \
        --scale "worker=${WORKERS}" --scale "gateway=${GATEWAYS}" \
        || fail "the deployment did not become healthy"
    [ "$(containers worker | wc -l)" -eq "${WORKERS}" ] || fail "not ${WORKERS} workers"
    [ "$(containers gateway | wc -l)" -eq "${GATEWAYS}" ] || fail "not ${GATEWAYS} gateways"

    say "traffic through nginx until every gateway and every worker has served some"
    until_every_replica_served gateway 5 gateway_finished
    for c in $(containers worker); do every_gateway_reaches "${c}"; done
    say "every worker hears from all ${GATEWAYS} gateways"
    until_every_replica_served worker 5 worker_finished
    report_load

    victim=$(containers worker | head -1)
    restarts=$(docker inspect -f '{{.RestartCount}}' "${victim}")
    say "SIGKILL to $(name_of "${victim}") (its init and the worker with it)"
    as_root kill -KILL "$(docker inspect -f '{{.State.Pid}}' "${victim}")"
    # The survivors answer while Docker restarts it and its model loads.
    read -r ok failed < <(send_completions 8 4)
    say "while it was down: ${ok} completions succeeded, ${failed} failed"
    [ "${ok}" -gt 0 ] || fail "no completion succeeded while one worker was down"

    for _ in $(seq 60); do
        [ "$(docker inspect -f '{{.RestartCount}}' "${victim}")" -gt "${restarts}" ] && break
        sleep 1
    done
    [ "$(docker inspect -f '{{.RestartCount}}' "${victim}")" -gt "${restarts}" ] \
        || fail "Docker did not restart $(name_of "${victim}")"
    wait_healthy "${victim}" 300
    say "$(name_of "${victim}") restarted and healthy; its counters start from zero"
    every_gateway_reaches "${victim}"
    until_every_replica_served worker 5 worker_finished
    report_load
    say "PASSED: ${WORKERS} workers and ${GATEWAYS} gateways behind nginx, a killed worker recovered"
}

main
