//! Host secrets through the core: the `/secrets` operations, grant checks
//! at create and fork, and syncing a VM's granted secrets into its guest
//! (at every boot, and on every running VM holding a grant when a secret
//! changes or goes).

use std::sync::Arc;

use tine_client::AgentClient;
use tine_proto::api::{CreateSecretRequest, SecretInfo, UpdateSecretRequest, VmState};

use super::daemon::Daemon;
use super::error::{chain, Error, Result};
use crate::secrets::{SecretError, SecretsDigest};

impl Daemon {
    /// Every secret's metadata.
    pub fn list_secrets(&self) -> Result<Vec<SecretInfo>> {
        Ok(self.secrets.list()?)
    }

    /// Creates a secret.
    pub fn create_secret(&self, req: &CreateSecretRequest) -> Result<SecretInfo> {
        let info = self.secrets.create(req)?;
        tracing::info!(secret = %info.name, bytes = info.size, "secret created");
        Ok(info)
    }

    /// Changes a secret and syncs it into every running VM granted it.
    pub fn update_secret(
        self: &Arc<Self>,
        name: &str,
        req: &UpdateSecretRequest,
    ) -> Result<SecretInfo> {
        let info = self.secrets.update(name, req)?;
        tracing::info!(secret = %name, bytes = info.size, "secret changed");
        self.resync_granted(name);
        Ok(info)
    }

    /// Deletes a secret and removes it from every running VM granted it
    /// (the grants stay, and name nothing until it is created again).
    pub fn delete_secret(self: &Arc<Self>, name: &str) -> Result<()> {
        self.secrets.delete(name)?;
        tracing::info!(secret = %name, "secret deleted");
        self.resync_granted(name);
        Ok(())
    }

    /// Checks the grants of a create or fork request: a secret that does
    /// not exist is the request's error (400), not a missing route.
    pub(super) fn check_grants(&self, names: &[String]) -> Result<()> {
        self.secrets.check_grants(names).map_err(|e| match e {
            SecretError::NotFound(_) => Error::BadRequest(format!("secrets: {e}")),
            other => other.into(),
        })
    }

    /// The digest of what [`Daemon::sync_secrets`] would write for VM
    /// `hostname` granted `grants`.
    pub(super) fn secrets_digest(
        &self,
        hostname: &str,
        grants: &[String],
    ) -> Result<SecretsDigest> {
        Ok(SecretsDigest::of(&self.secrets.files(hostname, grants)?))
    }

    /// Writes the VM's granted secrets into its guest (and removes any
    /// other) over `client`.
    pub(super) async fn sync_secrets(
        &self,
        hostname: &str,
        grants: &[String],
        client: &AgentClient,
    ) -> Result<()> {
        let files = self.secrets.files(hostname, grants)?;
        let count = files.len();
        let report = match client.secrets_sync(files).await {
            Ok(report) => report,
            // An agent older than secrets (in a disk committed before them)
            // never held any: nothing to remove.
            Err(tine_client::ClientError::Agent {
                code: tine_proto::agent::ErrorCode::UnknownOperation,
                ..
            }) if count == 0 => {
                tracing::info!(
                    vm = hostname,
                    "its agent has no secrets support; none to remove"
                );
                return Ok(());
            }
            Err(source) => {
                return Err(Error::Agent {
                    what: format!("sync secrets into {hostname}"),
                    source,
                })
            }
        };
        tracing::info!(
            vm = hostname,
            secrets = count,
            removed = report.removed.len(),
            "secrets synced"
        );
        Ok(())
    }

    /// Syncs every running VM granted `name` again, in the background; a
    /// VM that cannot be reached gets a log line (its next boot syncs).
    fn resync_granted(self: &Arc<Self>, name: &str) {
        let vms = match self.store.list_vms(None) {
            Ok(vms) => vms,
            Err(e) => {
                tracing::error!(secret = %name, "cannot list VMs to resync: {}", chain(&e));
                return;
            }
        };
        for vm in vms {
            if vm.state != VmState::Running || !vm.secrets.iter().any(|s| s == name) {
                continue;
            }
            let this = self.clone();
            tokio::spawn(async move {
                let synced = async {
                    let client = this.connect_agent(&vm.hostname).await?;
                    this.sync_secrets(&vm.hostname, &vm.secrets, &client).await
                };
                let limit = this.deadlines.setup_call;
                match tokio::time::timeout(limit, synced).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(vm = %vm.hostname, "resync of secrets failed: {}", chain(&e))
                    }
                    Err(_) => tracing::warn!(vm = %vm.hostname, "resync of secrets timed out"),
                }
            });
        }
    }
}
