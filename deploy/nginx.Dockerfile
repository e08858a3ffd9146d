# The compose load balancer where Docker Hub's nginx image cannot be pulled: Debian's nginx on
# the base image loomserve builds from. compose.yaml mounts deploy/nginx.conf over its config;
# wget is there for the compose health check, as in the official image.
#
#   docker build -f deploy/nginx.Dockerfile --build-arg BASE_IMAGE=debian:bookworm-slim \
#       -t loomserve-nginx deploy && NGINX_IMAGE=loomserve-nginx docker compose up -d
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends nginx wget \
    && rm -rf /var/lib/apt/lists/*
EXPOSE 8000
CMD ["nginx", "-g", "daemon off;"]
