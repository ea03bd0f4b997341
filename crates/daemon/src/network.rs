//! TEMP(net): replaced by the network module from the `net` branch.

use serde::{Deserialize, Serialize};

/// Network mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetMode {
    /// No NIC.
    #[default]
    None,
}

/// Group network config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkConfig {
    /// Mode.
    #[serde(default)]
    pub mode: NetMode,
}

/// Validates.
pub fn validate(_group: &str, _cfg: &NetworkConfig) -> Result<(), std::io::Error> {
    Ok(())
}
