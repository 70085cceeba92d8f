# PostgreSQL 15 from Debian's packages, behaving as compose.yaml uses postgres:16 (POSTGRES_USER, POSTGRES_DB and
# POSTGRES_PASSWORD create the role and database at the first start; data in /var/lib/postgresql/data; pg_isready
# on PATH): for hosts that reach Debian's mirror but no image registry. docker/debian/images.sh.
ARG BASE_IMAGE=localhost/pfl-edge-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /run/postgresql
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
VOLUME /var/lib/postgresql/data
EXPOSE 5432
USER postgres
ENTRYPOINT ["sh", "/usr/local/bin/postgres-entrypoint"]
CMD ["postgres"]
