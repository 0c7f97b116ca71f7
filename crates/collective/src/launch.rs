//! A loaded entry point bound to its parameter layout, and the one unsafe launch.

use mori_gpu::StreamHandle;
use mori_gpu::jit::{Function, Module};
use mori_gpu::kernels::{LaunchConfig, launch_packed};

use crate::error::{Error, Result};
use crate::params::{Layout, Packed, Packer};

/// Kernel `entry` of a loaded module, with the layout its parameters must have.
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    entry: &'static str,
    layout: &'static Layout,
    function: Function,
}

impl Kernel {
    /// Looks up `entry`'s layout and its function in `module`.
    pub fn load(module: &Module, entry: &str) -> Result<Self> {
        let (entry, layout) = crate::lookup(entry)?;
        Ok(Self {
            entry,
            layout,
            function: module.function(entry)?,
        })
    }

    pub fn entry(&self) -> &'static str {
        self.entry
    }

    pub fn layout(&self) -> &'static Layout {
        self.layout
    }

    /// An empty parameter set of this entry, to fill field by field.
    pub fn packer(&self) -> Packer {
        Packer::new(self.entry, self.layout)
    }

    /// Launches the kernel with `params`, which must be this entry's layout.
    ///
    /// # Safety
    /// Every address in `params` must be valid for what the kernel does with it until the
    /// kernel has run, as with any CUDA launch.
    pub unsafe fn launch(
        &self,
        cfg: LaunchConfig,
        stream: StreamHandle,
        params: Packed,
    ) -> Result<()> {
        if !std::ptr::eq(params.layout(), self.layout) {
            return Err(Error::WrongParams {
                entry: self.entry,
                given: params.layout().name,
            });
        }
        let (mut buf, len) = params.into_buffer();
        // SAFETY: the bytes follow this entry's Rust layout, which tests/nvrtc_layout.rs checks
        // against the kernel's signature; the caller vouches for the addresses in them.
        Ok(unsafe { launch_packed(self.function, cfg, stream, &mut buf[..len]) }?)
    }
}
