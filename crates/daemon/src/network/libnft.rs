//! nft scripts run in-process through libnftables, the library behind the
//! `nft` command (`nft -f` without a process per change: spawning `nft`
//! costs more than the transaction itself). The library is loaded when the
//! first script runs, so a host without nftables fails only when it needs
//! a rule, naming what is missing.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::ptr::NonNull;

use super::error::NetworkError;

/// The library's soname (its ABI has been stable since nftables 0.9).
pub(crate) const LIBRARY: &str = "libnftables.so.1";

/// `NFT_CTX_DEFAULT` of `nft_ctx_new`.
const NFT_CTX_DEFAULT: u32 = 0;
/// `NFT_CTX_OUTPUT_JSON` of `nft_ctx_output_set_flags`.
const NFT_CTX_OUTPUT_JSON: c_uint = 1 << 4;

type CtxNew = unsafe extern "C" fn(u32) -> *mut c_void;
type CtxFree = unsafe extern "C" fn(*mut c_void);
type CtxFlagsGet = unsafe extern "C" fn(*mut c_void) -> c_uint;
type CtxFlagsSet = unsafe extern "C" fn(*mut c_void, c_uint);
type CtxBuffer = unsafe extern "C" fn(*mut c_void) -> c_int;
type CtxGetBuffer = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type RunCmd = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;

/// The functions of libnftables we use.
struct Functions {
    ctx_free: CtxFree,
    output_get_flags: CtxFlagsGet,
    output_set_flags: CtxFlagsSet,
    get_output_buffer: CtxGetBuffer,
    get_error_buffer: CtxGetBuffer,
    run_cmd_from_buffer: RunCmd,
}

/// One libnftables context with its output and errors captured.
pub(crate) struct Nftables {
    ctx: NonNull<c_void>,
    functions: Functions,
    /// Keeps the code behind `functions` mapped; dropped last.
    _library: libloading::Library,
}

// SAFETY: an `nft_ctx` has no tie to the thread that made it; `Nftables`
// hands out no pointer into it, and `&mut self` on every call (the
// manager's lock) keeps two threads from using it at once.
unsafe impl Send for Nftables {}

impl std::fmt::Debug for Nftables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nftables").finish_non_exhaustive()
    }
}

fn load_err(source: libloading::Error) -> NetworkError {
    NetworkError::NftLibrary {
        library: LIBRARY,
        source,
    }
}

/// Copies a symbol's function pointer out of the library.
///
/// # Safety
/// `T` must be the C signature of `name`.
unsafe fn function<T: Copy>(library: &libloading::Library, name: &[u8]) -> Result<T, NetworkError> {
    // SAFETY: the caller guarantees the signature; the pointer is used only
    // while `library` stays loaded (`Nftables` owns both).
    unsafe {
        library
            .get::<T>(name)
            .map(|symbol| *symbol)
            .map_err(load_err)
    }
}

impl Nftables {
    /// Loads libnftables and makes a context that buffers its output and
    /// error messages.
    pub(crate) fn open() -> Result<Self, NetworkError> {
        // SAFETY: loading libnftables runs its (and its dependencies')
        // initializers, which only set up the library's own state.
        let library = unsafe { libloading::Library::new(LIBRARY) }.map_err(load_err)?;
        // SAFETY: each type is the function's prototype in <nftables/libnftables.h>.
        let (ctx_new, buffer_output, buffer_error, functions) = unsafe {
            (
                function::<CtxNew>(&library, b"nft_ctx_new\0")?,
                function::<CtxBuffer>(&library, b"nft_ctx_buffer_output\0")?,
                function::<CtxBuffer>(&library, b"nft_ctx_buffer_error\0")?,
                Functions {
                    ctx_free: function(&library, b"nft_ctx_free\0")?,
                    output_get_flags: function(&library, b"nft_ctx_output_get_flags\0")?,
                    output_set_flags: function(&library, b"nft_ctx_output_set_flags\0")?,
                    get_output_buffer: function(&library, b"nft_ctx_get_output_buffer\0")?,
                    get_error_buffer: function(&library, b"nft_ctx_get_error_buffer\0")?,
                    run_cmd_from_buffer: function(&library, b"nft_run_cmd_from_buffer\0")?,
                },
            )
        };
        // SAFETY: `nft_ctx_new` takes a flags word and returns a new context
        // or NULL.
        let ctx = NonNull::new(unsafe { ctx_new(NFT_CTX_DEFAULT) })
            .ok_or(NetworkError::NftContext { library: LIBRARY })?;
        let nft = Self {
            ctx,
            functions,
            _library: library,
        };
        // SAFETY: `ctx` is a live context; both calls only switch its
        // output and errors to in-memory buffers.
        let buffered =
            unsafe { buffer_output(ctx.as_ptr()) == 0 && buffer_error(ctx.as_ptr()) == 0 };
        if !buffered {
            return Err(NetworkError::NftContext { library: LIBRARY });
        }
        Ok(nft)
    }

    /// Takes what the context buffered since the last call.
    fn take(&mut self, get: CtxGetBuffer) -> String {
        // SAFETY: `ctx` is live and buffered; the returned string is the
        // context's own NUL-terminated buffer (or NULL), valid until the
        // next call into the context, and copied out before that.
        unsafe {
            let text = get(self.ctx.as_ptr());
            if text.is_null() {
                String::new()
            } else {
                CStr::from_ptr(text).to_string_lossy().into_owned()
            }
        }
    }

    /// Runs `script` as `nft -f` would (one transaction: all of it or
    /// nothing) and returns what it printed.
    pub(crate) fn run(&mut self, script: &str) -> Result<String, NetworkError> {
        let input = CString::new(script).map_err(|_| NetworkError::Nft {
            error: "the script contains a NUL byte".to_owned(),
            input: script.replace('\0', "\\0"),
        })?;
        // SAFETY: `ctx` is live and `input` a NUL-terminated string that
        // outlives the call, which only reads it.
        let status =
            unsafe { (self.functions.run_cmd_from_buffer)(self.ctx.as_ptr(), input.as_ptr()) };
        let output = self.take(self.functions.get_output_buffer);
        let error = self.take(self.functions.get_error_buffer);
        if status != 0 {
            return Err(NetworkError::Nft {
                error: error.trim().to_owned(),
                input: script.to_owned(),
            });
        }
        Ok(output)
    }

    /// Runs `command` with JSON output (`nft -j`) and returns the JSON.
    pub(crate) fn run_json(&mut self, command: &str) -> Result<String, NetworkError> {
        // SAFETY: `ctx` is live; these only read and set its output flags.
        let flags = unsafe { (self.functions.output_get_flags)(self.ctx.as_ptr()) };
        // SAFETY: as above.
        unsafe {
            (self.functions.output_set_flags)(self.ctx.as_ptr(), flags | NFT_CTX_OUTPUT_JSON)
        };
        let result = self.run(command);
        // SAFETY: as above.
        unsafe { (self.functions.output_set_flags)(self.ctx.as_ptr(), flags) };
        result
    }
}

impl Drop for Nftables {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from `nft_ctx_new`, is freed only here, and the
        // library is still loaded (`_library` drops after this).
        unsafe { (self.functions.ctx_free)(self.ctx.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_script_reports_nft_error_and_input() {
        // Needs libnftables (the nftables package); parsing needs no root.
        let mut nft = Nftables::open().unwrap_or_else(|e| panic!("{e}"));
        let err = nft
            .run("add tabel inet tine_unit\n")
            .expect_err("syntax error");
        let NetworkError::Nft { error, input } = &err else {
            panic!("wrong error: {err}");
        };
        assert!(error.contains("syntax error"), "{error}");
        assert_eq!(input, "add tabel inet tine_unit\n");
        assert!(err.to_string().contains("--- input ---"), "{err}");
        // The context stays usable, and its error buffer was emptied.
        let err = nft.run("bogus\n").expect_err("syntax error");
        assert!(!err.to_string().contains("tabel"), "{err}");
        let err = nft.run("a\0b").expect_err("NUL");
        assert!(err.to_string().contains("NUL"), "{err}");
    }
}
