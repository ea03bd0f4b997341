//! Public SSH keys for a new VM: the `ssh_keys` lines of a create request,
//! and `import_user`'s keys fetched from GitHub (`https://github.com/USER.keys`,
//! or the configured `import_keys_url`) when the VM is created, so a boot
//! never depends on the network.

use std::io::Read as _;
use std::time::Duration;

use tine_proto::agent::AuthorizedKeysRequest;

/// Where `import_user` keys come from by default.
pub const DEFAULT_IMPORT_URL: &str = "https://github.com/{user}.keys";
/// Most keys one VM gets.
pub const MAX_KEYS: usize = 64;
/// Most bytes of an import answer read.
const MAX_ANSWER_BYTES: u64 = 256 * 1024;
/// Time limit of an import.
const IMPORT_TIMEOUT: Duration = Duration::from_secs(15);

/// What went wrong with a VM's keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// An `ssh_keys` entry is not one `authorized_keys` line.
    #[error("ssh_keys[{index}] is not one authorized_keys line (`TYPE BASE64 [COMMENT]`, no line breaks, at most 16 KiB)")]
    BadKey {
        /// Its position.
        index: usize,
    },
    /// Too many keys.
    #[error("{count} SSH keys is more than the limit of {MAX_KEYS}")]
    TooMany {
        /// How many there were.
        count: usize,
    },
    /// `import_user` is not a GitHub user name.
    #[error("import_user {0:?} is not a GitHub user name (letters, digits and '-', at most 39)")]
    BadUser(String),
    /// The key server could not be asked or answered an error.
    #[error("import_user {user}: cannot fetch {url}")]
    Fetch {
        /// The user.
        user: String,
        /// The URL asked.
        url: String,
        /// Why.
        #[source]
        source: Box<ureq::Error>,
    },
    /// The answer held no usable key.
    #[error("import_user {user}: {url} lists no public SSH keys")]
    NoKeys {
        /// The user.
        user: String,
        /// The URL asked.
        url: String,
    },
}

/// Checks the `ssh_keys` of a request.
pub fn check(keys: &[String]) -> Result<(), KeyError> {
    if keys.len() > MAX_KEYS {
        return Err(KeyError::TooMany { count: keys.len() });
    }
    match keys
        .iter()
        .position(|k| !AuthorizedKeysRequest::valid_key(k))
    {
        Some(index) => Err(KeyError::BadKey { index }),
        None => Ok(()),
    }
}

fn valid_github_user(user: &str) -> bool {
    !user.is_empty()
        && user.len() <= 39
        && !user.starts_with('-')
        && user.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// Fetches `user`'s public keys from `template` (`{user}` replaced), one
/// `authorized_keys` line each. Blocking: call it off the async threads.
pub fn import(template: &str, user: &str) -> Result<Vec<String>, KeyError> {
    if !valid_github_user(user) {
        return Err(KeyError::BadUser(user.to_owned()));
    }
    let url = template.replace("{user}", user);
    let fetch_err = |source| KeyError::Fetch {
        user: user.to_owned(),
        url: url.clone(),
        source: Box::new(source),
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(IMPORT_TIMEOUT))
        .build()
        .into();
    let mut answer = agent.get(&url).call().map_err(fetch_err)?;
    let mut text = String::new();
    answer
        .body_mut()
        .as_reader()
        .take(MAX_ANSWER_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| fetch_err(ureq::Error::Io(e)))?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && AuthorizedKeysRequest::valid_key(l))
        .take(MAX_KEYS)
        .map(|l| format!("{l} {user}@github"))
        .collect();
    if keys.is_empty() {
        return Err(KeyError::NoKeys {
            user: user.to_owned(),
            url,
        });
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead as _, BufReader, Write as _};
    use std::net::TcpListener;

    use super::*;

    /// A one-request HTTP server answering `status` and `body`; returns
    /// its URL template and the request line it got.
    fn serve_once(status: &str, body: &str) -> (String, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (status, body) = (status.to_owned(), body.to_owned());
        let handle = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut request_line = String::new();
            reader.read_line(&mut request_line).expect("read");
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).expect("header");
                if line.trim().is_empty() {
                    break;
                }
            }
            let mut out = stream;
            write!(
                out,
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .expect("answer");
            request_line
        });
        (format!("http://127.0.0.1:{port}/{{user}}.keys"), handle)
    }

    #[test]
    fn an_import_fetches_the_users_keys_and_names_them() {
        let (url, server) = serve_once(
            "200 OK",
            "ssh-ed25519 AAAAC3one\nssh-rsa AAAAB3two\n\nbad\u{1b}line x\n",
        );
        let keys = import(&url, "octo-cat").expect("import");
        assert_eq!(
            keys,
            [
                "ssh-ed25519 AAAAC3one octo-cat@github",
                "ssh-rsa AAAAB3two octo-cat@github"
            ]
        );
        assert!(server
            .join()
            .expect("server")
            .starts_with("GET /octo-cat.keys "));
    }

    #[test]
    fn an_unknown_user_or_an_empty_list_is_an_error_that_names_the_user() {
        let (url, server) = serve_once("404 Not Found", "Not Found");
        let err = import(&url, "nobody").expect_err("404");
        assert!(err.to_string().contains("nobody"), "{err}");
        assert!(matches!(err, KeyError::Fetch { .. }), "{err}");
        server.join().expect("server");
        let (url, server) = serve_once("200 OK", "");
        let err = import(&url, "nokeys").expect_err("no keys");
        assert!(matches!(err, KeyError::NoKeys { .. }), "{err}");
        server.join().expect("server");
        for bad in ["", "-x", "a/b", "a b", &"x".repeat(40)] {
            let err = import(&url, bad).expect_err(bad);
            assert!(matches!(err, KeyError::BadUser(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn key_lines_are_checked() {
        check(&["ssh-ed25519 AAAA me".into()]).expect("fine");
        let err = check(&["ssh-ed25519 AAAA".into(), "one".into()]).expect_err("bad");
        assert!(matches!(err, KeyError::BadKey { index: 1 }), "{err}");
        let err = check(&["a\nb c".into()]).expect_err("newline");
        assert!(matches!(err, KeyError::BadKey { index: 0 }), "{err}");
        let many = vec!["ssh-rsa AAAA".to_string(); MAX_KEYS + 1];
        assert!(matches!(check(&many), Err(KeyError::TooMany { .. })));
    }
}
