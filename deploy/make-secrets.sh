#!/bin/sh
# Writes the secret files docker-compose.yml reads (its top-level `secrets:`), from fresh random values:
#
#   sh deploy/make-secrets.sh            # into deploy/secrets/ (git- and docker-ignored)
#   sh deploy/make-secrets.sh DIR        # elsewhere (then point the compose `secrets:` there)
#
# postgres_password   PostgreSQL's password for the `loramux` role (POSTGRES_PASSWORD_FILE)
# database_url        the registry's --database-url-file: the same password inside the URL
# aws_credentials     an AWS shared-credentials file (AWS_SHARED_CREDENTIALS_FILE) for the registry and
#                     the create-bucket job
# seaweedfs_s3.json   SeaweedFS's S3 identity (-s3.config) holding the same access key and secret
#
# Existing files are never overwritten: PostgreSQL takes its password only when it first creates its
# data volume, so new values for an existing stack would lock the registry out (see deploy/README.md).
set -eu

dir=${1:-$(dirname "$0")/secrets}
names="postgres_password database_url aws_credentials seaweedfs_s3.json"
for name in $names; do
    if [ -e "$dir/$name" ]; then
        echo "$dir/$name exists; nothing written (remove the directory's files to make new ones)" >&2
        exit 1
    fi
done

# 24 random bytes as hex: safe inside a URL and a JSON string without escaping.
random_hex() { od -An -tx1 -N24 /dev/urandom | tr -d ' \n'; }
password=$(random_hex)
access_key=loramux-$(od -An -tx1 -N6 /dev/urandom | tr -d ' \n')
secret_key=$(random_hex)

# The directory is the host's guard (0700). The files are 0644 because Compose bind-mounts them as they
# are into containers that run as other users (postgres, uid 10001); the 0700 directory keeps other host
# users out.
umask 022
mkdir -p "$dir"
chmod 700 "$dir"

printf '%s\n' "$password" >"$dir/postgres_password"
printf 'postgresql+psycopg://loramux:%s@postgres:5432/loramux\n' "$password" >"$dir/database_url"
printf '[default]\naws_access_key_id = %s\naws_secret_access_key = %s\n' "$access_key" "$secret_key" \
    >"$dir/aws_credentials"
cat >"$dir/seaweedfs_s3.json" <<EOF
{
  "identities": [
    {
      "name": "loramux",
      "credentials": [{"accessKey": "$access_key", "secretKey": "$secret_key"}],
      "actions": ["Admin", "Read", "List", "Tagging", "Write"]
    }
  ]
}
EOF
echo "wrote $names into $dir"
